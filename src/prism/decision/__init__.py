"""Decision requests: several questions forked from one material, read out as probabilities (issue 7: not built yet)."""
