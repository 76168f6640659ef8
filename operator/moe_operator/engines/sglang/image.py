"""sglang's public image (.github/workflows/release-docker.yml, _docker-build-and-publish.yml): lmsysorg/sglang:
v<ver> is a multi-arch manifest of an amd64 image and an arm64 one built with GRACE_BLACKWELL=1; newer releases
push the per-arch images by digest only, so the manifest tag is the only arm64 reference for every release."""

REPOSITORY = "lmsysorg/sglang"
ARM64_TAG_SUFFIX = ""  # the multi-arch manifest tag serves arm64
