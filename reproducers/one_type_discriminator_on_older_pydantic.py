"""Found in session 14: the GPU machine's pydantic 2.11 refused to build the chat schema ("Discriminator must be used
with a Union type, not TextPart"): `TextOnlyPart` was a tagged union of one member, which newer pydantic accepts and
2.11 does not, so no server test there could even be collected. The project asks for `pydantic>=2.11`; this checks,
on whatever pydantic is installed, that no `Discriminator` in the request schema wraps a single type."""

import types
import typing

import _common  # noqa: F401
from pydantic import Discriminator

from prism.serving import protocol

UNIONS = (typing.Union, types.UnionType)


def one_type_discriminators(alias: object, where: str) -> list[str]:
    found = []
    if typing.get_origin(alias) is typing.Annotated:
        inner, *metadata = typing.get_args(alias)
        # Annotated flattens: Annotated[Annotated[T, Tag], Discriminator] is Annotated[T, Tag, Discriminator].
        if any(isinstance(m, Discriminator) for m in metadata) and typing.get_origin(inner) not in UNIONS:
            found.append(where)
        found += one_type_discriminators(inner, where)
    for arg in typing.get_args(alias):
        if typing.get_origin(arg) is not None:
            found += one_type_discriminators(arg, where)
    return found


bad = [hit for name, value in vars(protocol).items() for hit in one_type_discriminators(value, name)]
_common.verdict(
    not bad,
    "every Discriminator in the request schema wraps a union",
    f"a Discriminator wraps a single type in {sorted(set(bad))} (pydantic 2.11 refuses to build that schema)",
)
