"""One DeepSeek-V3 MoE forward on the default config, for Nsight Compute (`ncu -k regex:frag ...`):
the fragment kernel's launches at a given token count, nothing timed here.

  ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:frag \\
      python bench/profile_frag.py --tokens 64 --format nvfp4
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

from bench_moe import DEV, E, H, K, random_weights  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--format", default="nvfp4")
args = ap.parse_args()
g = torch.Generator(device=DEV).manual_seed(0)
ex = TritonExperts(random_weights(args.format, g))
x = torch.randn(args.tokens, H, device=DEV, generator=g).to(torch.bfloat16)
w, ids = softmax_topk(torch.randn(args.tokens, E, device=DEV, generator=g), K, True)
for _ in range(2):
    ex.forward(x, w, ids)
torch.cuda.synchronize()
print("config", ex.config or "default", flush=True)
