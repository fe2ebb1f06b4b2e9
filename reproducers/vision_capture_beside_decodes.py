"""Found in session 10 (H200, W4 interleaved): a vision-graph capture takes ~50-60 ms of its step, and a grid list
first seen beside running decodes was captured in such a step, so every running stream waited that long for its
next token. A step whose rows decode does not capture (`StepPayload.beside_decodes`): the list stays eager until a
step without decodes encodes it (or until it has been encoded 2 * capture_after times). Checked on the CPU with a
stand-in graph cache that would capture at the first encoding."""

import _common  # noqa: F401

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.engine.vision_graphs import VisionGraphs  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

eng = LLM(ensure_tiny_checkpoint(), page_size=8, num_gpu_pages=256, encode_media_while_preparing=False).engine
runner = eng.runner
beside_decodes_of_step, captured_in = [], []
run = runner.run


def recorded_run(payload, *rest):
    beside_decodes_of_step.append(payload.beside_decodes)
    return run(payload, *rest)


def capture(pixels, grids):
    captured_in.append(len(beside_decodes_of_step) - 1)
    raise RuntimeError("stand-in: no CUDA graph on the CPU (logged; the list stays eager)")


runner.run = recorded_run
runner.vision_graphs = VisionGraphs(runner.model.encode_media, capture, max_graphs=2, capture_after=1)
for i in range(2):
    eng.add_request(f"text{i}", f"Count to ten, number {i}.", SamplingParams.greedy(max_tokens=12, ignore_eos=True))
for _ in range(3):
    eng.step()
images = random_images([(64, 64), (48, 80)], seed=11)
eng.add_request("cold", [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                                      {"type": "text", "text": "What do you see?"}]}],
                SamplingParams.greedy(max_tokens=4, ignore_eos=True))
while eng.has_unfinished_requests():
    eng.step()
beside = [i for i in captured_in if beside_decodes_of_step[i]]
_common.verdict(
    not beside and any(beside_decodes_of_step),
    f"no vision-graph capture in the {sum(beside_decodes_of_step)} steps that decoded",
    f"a vision graph was captured in step(s) {beside} that also decoded (~50-60 ms each on the H200)",
)
