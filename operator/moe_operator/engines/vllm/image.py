"""vLLM's public image (.buildkite/scripts, the release-image publishing script): vllm/vllm-openai:v<ver> is a
multi-arch manifest of v<ver>-x86_64 and v<ver>-aarch64; the per-arch tags are pushed too, so an arm64 node gets
the aarch64 tag by name."""

REPOSITORY = "vllm/vllm-openai"
ARM64_TAG_SUFFIX = "-aarch64"
