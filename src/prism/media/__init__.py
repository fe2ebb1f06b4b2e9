"""Media preparation: decoding with limits, Qwen smart resize and patchify, video sampling, content
digests (same decoded pixels + processor layout <=> same digest), the preprocessing cache, and the
expansion of image/video placeholders into tokens."""
