"""sglang's Triton fused-MoE kernel as a benchmark peer, loaded from an sglang wheel (never copied here).

The wheel (a zip) is unpacked into a temporary directory; only the kernel module (the file defining
`fused_moe_kernel` and its launcher `invoke_fused_moe_kernel`: sglang/srt/layers/moe/moe_runner/
triton_utils/fused_moe_triton_kernels.py in 0.5.14, sglang/kernels/ops/moe/ in later releases) and the
tuned config tables (`configs/triton_<version>/E=..,N=..,device_name=...json`) are used. The module is
imported by path; its `from sglang... import` lines get minimal stand-ins, none of which is on the GEMM
path except:
- the FP8 activation quantization the launcher calls (`sglang_per_token_group_quant_fp8`, a CUDA
  extension in sglang): here it hands back activations the caller quantized beforehand
  (`register_fp8`), so a timed launch is the GEMM alone; unregistered input is quantized in torch
  (same rule: per 128-group scale = amax / 448, min 1e-10);
- `is_sm90_supported` (decides the launcher's swap_ab): compute capability 9.x with CUDA >= 12.3, as
  sglang's; `get_moe_padding_size`: 0 (sglang's default without SGLANG_MOE_PADDING).
`moe_align_block_size` (sgl_kernel) is replaced by `align_block_size` below, in torch (not timed).
"""

from __future__ import annotations

import ast
import atexit
import glob
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import types
import zipfile

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WHEEL_DIRS = (os.path.join(REPO, ".whl"), "/tmp/sgl")
FP8_MAX = 448.0
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def _version(path: str) -> tuple[int, ...]:
    m = re.search(r"sglang-(\d+(?:\.\d+)*)", os.path.basename(path))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def find_wheel(path: str | None = None) -> str:
    """`path` if given, else the newest sglang-*.whl in .whl/ (repository root), then /tmp/sgl."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"sglang wheel not found: {path}")
        return path
    for d in WHEEL_DIRS:
        found = sorted(glob.glob(os.path.join(d, "sglang-*.whl")), key=_version)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no sglang-*.whl in {' or '.join(WHEEL_DIRS)} (pass --sglang-wheel)")


# ------------------------------------------------------------------------------------------ stand-ins
def quant_fp8_groups(x: torch.Tensor, group: int = 128, eps: float = 1e-10):
    """Per-token-group FP8 (e4m3) quantization: ([M, K] fp8, [M, K/group] fp32 scales)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the FP8 group size {group}")
    xg = x.float().view(m, k // group, group)
    scale = xg.abs().amax(-1).clamp(min=eps) / FP8_MAX
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale.contiguous()


_PREQUANT: dict = {}


def register_fp8(q: torch.Tensor, scale: torch.Tensor) -> None:
    """Activations quantized by the caller: the launcher's quantization step returns them as they are."""
    _PREQUANT[(q.data_ptr(), tuple(q.shape))] = (q, scale)


def clear_fp8() -> None:
    """Forget the registered activations (they are kept alive while registered)."""
    _PREQUANT.clear()


def _group_quant_fp8(x, group_size, *args, **kwargs):
    if x.dtype == torch.float8_e4m3fn:
        hit = _PREQUANT.get((x.data_ptr(), tuple(x.shape)))
        if hit is None:
            raise RuntimeError("FP8 activations passed to the peer without register_fp8(q, scale)")
        return hit
    return quant_fp8_groups(x, group_size)


def _sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 3)


def _sm90_or_later() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


class _Env:
    def __init__(self, name):
        self.name = name

    def get(self):
        v = os.environ.get(self.name)
        return False if v is None else v.lower() in ("1", "true", "yes")


class _Envs:
    def __getattr__(self, name):
        return _Env(name)


def _env_bool(name, default="false"):
    return str(os.environ.get(name, default)).lower() in ("1", "true", "yes")


SHIMS = {
    "is_batch_invariant_mode_enabled": lambda: False,
    "get_moe_padding_size": lambda *a, **k: 0,
    "cpu_has_amx_support": lambda: False,
    "is_cpu": lambda: False,
    "is_cuda": lambda: True,
    "is_hip": lambda: False,
    "is_xpu": lambda: False,
    "is_musa": lambda: False,
    "is_npu": lambda: False,
    "is_sm90_supported": _sm90,
    "is_arch_support_pdl": _sm90_or_later,
    "get_bool_env_var": _env_bool,
    "per_token_group_quant_fp8": _group_quant_fp8,
    "sglang_per_token_group_quant_fp8": _group_quant_fp8,
    "envs": _Envs(),
}


class PeerNameMissing(RuntimeError):
    """The kernel file called an sglang name the loader deliberately does not provide (only the names
    the timed launch needs are given, SHIMS); a cell that reaches one fails with this, not silently."""


def _missing(name):
    def f(*args, **kwargs):
        raise PeerNameMissing(f"{name}: not provided by the sglang peer loader (bench/peer_sglang.py)")
    f.__name__ = name
    return f


def _install_stand_ins(source: str) -> list[str]:
    """Stub modules for every `sglang...` module the kernel file imports (at any level), carrying
    SHIMS or a raising placeholder for each imported name. Returns the stubbed module names."""
    names: dict[str, set] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
            names.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sglang":
                    names.setdefault(a.name, set())
    for mod, attrs in names.items():
        parts = mod.split(".")
        for n in range(1, len(parts) + 1):
            sub = ".".join(parts[:n])
            if sub not in sys.modules:
                m = types.ModuleType(sub)
                m.__path__ = []   # a package, so submodules resolve
                sys.modules[sub] = m
                if n > 1:
                    setattr(sys.modules[".".join(parts[:n - 1])], parts[n - 1], m)
        m = sys.modules[mod]
        for a in attrs:
            if not hasattr(m, a):
                setattr(m, a, SHIMS.get(a) or _missing(a))
    return sorted(names)


# ------------------------------------------------------------------------------------------- the peer
class SglangPeer:
    """The unpacked wheel: `.kernels` (the kernel module), `.invoke` (invoke_fused_moe_kernel),
    `.tuned(E, N, dtype, block_shape)` (sglang's tuned table for this GPU)."""

    def __init__(self, wheel: str | None = None, workdir: str | None = None):
        self.wheel = find_wheel(wheel)
        self.dir = workdir or tempfile.mkdtemp(prefix="sglang_peer_")
        if workdir is None:
            atexit.register(shutil.rmtree, self.dir, True)
        with zipfile.ZipFile(self.wheel) as z:
            members = z.namelist()
            kernel = [n for n in members if n.endswith("fused_moe_triton_kernels.py")]
            configs = [n for n in members if n.endswith(".json") and "/configs/triton_" in n
                       and os.path.basename(n).startswith("E=")]
            for n in kernel + configs:
                z.extract(n, self.dir)
            dist = [n for n in members if n.endswith(".dist-info/METADATA")]
            meta = z.read(dist[0]).decode(errors="replace") if dist else ""
        m = re.search(r"^Version:\s*(\S+)", meta, re.M)
        self.version = m.group(1) if m else ".".join(map(str, _version(self.wheel))) or "?"
        path = None
        for n in kernel:
            text = open(os.path.join(self.dir, n)).read()
            if "def fused_moe_kernel(" in text and "def invoke_fused_moe_kernel(" in text:
                path, source = os.path.join(self.dir, n), text
                break
        if path is None:
            raise RuntimeError(f"{self.wheel}: no file defines fused_moe_kernel and invoke_fused_moe_kernel")
        self.kernel_file = os.path.relpath(path, self.dir)
        self.stubbed = _install_stand_ins(source)
        spec = importlib.util.spec_from_file_location("sglang_peer_fused_moe_triton_kernels", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        self.kernels = mod
        self.invoke = mod.invoke_fused_moe_kernel
        # {triton version tuple: directory} of the tuned tables
        self.config_dirs = {}
        for n in configs:
            d = os.path.dirname(n)
            v = os.path.basename(d)[len("triton_"):]
            try:
                self.config_dirs[tuple(int(x) for x in v.split("_"))] = os.path.join(self.dir, d)
            except ValueError:
                continue

    def describe(self) -> str:
        return (f"sglang {self.version} from {self.wheel}: {self.kernel_file} "
                f"(stand-ins for {', '.join(self.stubbed)})")

    def tuned(self, e: int, n: int, dtype: str | None, block_shape=None, device_name: str | None = None,
              down: bool = False):
        """sglang's lookup (get_moe_configs): the table for this Triton version, else the newest other
        version's. Returns ({M: config}, path) or (None, None)."""
        import triton
        dev = (device_name or torch.cuda.get_device_name()).replace(" ", "_")
        name = (f"E={e},N={n},device_name={dev}" + (f",dtype={dtype}" if dtype else "")
                + (f",block_shape={list(block_shape)}" if block_shape and all(block_shape) else "")
                + ("_down" if down else "") + ".json")
        try:
            mine = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
        except ValueError:
            mine = ()
        order = sorted(self.config_dirs, reverse=True)
        if mine in self.config_dirs:
            order.remove(mine)
            order.insert(0, mine)
        for v in order:
            p = os.path.join(self.config_dirs[v], name)
            if os.path.exists(p):
                with open(p) as f:
                    return {int(k): clean_config(c) for k, c in json.load(f).items()}, p
        return None, None


def clean_config(cfg: dict) -> dict:
    """The launch keys of a tuned entry (USE_TMA and vendor extras dropped)."""
    return {k: int(cfg[k]) for k in CONFIG_KEYS if k in cfg}


def nearest(table: dict, m: int) -> dict:
    """sglang's pick from a tuned table: the entry whose token count is closest to m."""
    return dict(table[min(table, key=lambda x: abs(x - m))])


def align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """moe_align_block_size in torch, same outputs as sgl_kernel's: (sorted_token_ids int32 [P] with
    padding slots = topk_ids.numel(), expert_ids int32 [P / block_size] (-1 past the used blocks),
    num_tokens_post_padded int32 [1]), each expert's pairs in flat (token, slot) order."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    if numel < num_experts + 1:
        max_padded = numel * block_size
    else:
        max_padded = numel + (num_experts + 1) * (block_size - 1)
    dev = flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    pos = starts[sorted_e] + torch.arange(numel, device=dev) - first[sorted_e]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    blocks = -(-max_padded // block_size)
    expert_ids = torch.full((blocks,), -1, dtype=torch.int32, device=dev)
    used = torch.repeat_interleave(torch.arange(num_experts, device=dev), padded // block_size)
    expert_ids[: used.numel()] = used.to(torch.int32)
    post = padded.sum().to(torch.int32).reshape(1)
    return sorted_ids, expert_ids, post


class PeerMoE:
    """GEMM1 + GEMM2 of sglang's fused MoE on fixed inputs (the way fused_moe.py launches them):
    GEMM1 x @ w1^T into [T*K, 2I]; GEMM2 act @ w2^T times the routing weight into [T, K, H]. The
    activation between (SiLU(gate) * up, FP8 quantization) is computed once, outside `run`.

    w1 [E, 2I, H], w2 [E, H, I]: bf16, or float8_e4m3fn with w1_scale / w2_scale fp32 per 128x128 block."""

    def __init__(self, peer: SglangPeer, w1, w2, w1_scale=None, w2_scale=None):
        self.peer, self.w1, self.w2, self.w1_scale, self.w2_scale = peer, w1, w2, w1_scale, w2_scale
        self.fp8 = w1.dtype == torch.float8_e4m3fn

    def prepare(self, x, topk_weights, topk_ids, up: dict, down: dict | None = None):
        """Launch both GEMMs once (their inputs set up); returns (run, output [T, H] bf16 of the top-k sum)."""
        import triton.language as tl
        down = dict(down or up)
        if down["BLOCK_SIZE_M"] != up["BLOCK_SIZE_M"]:
            down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]   # one alignment for both, as sglang does
        t, k = topk_ids.shape
        e, n1, h = self.w1.shape
        inter = self.w2.shape[2]
        dev = x.device
        tw = topk_weights.float().contiguous()
        ids = topk_ids.contiguous()
        sorted_ids, expert_ids, post = align_block_size(ids, up["BLOCK_SIZE_M"], e)
        cache1 = torch.empty(t * k, n1, dtype=torch.bfloat16, device=dev)
        cache3 = torch.empty(t, k, h, dtype=torch.bfloat16, device=dev)
        common = dict(compute_type=tl.bfloat16, use_fp8_w8a8=self.fp8, use_int8_w8a8=False,
                      use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                      block_shape=[128, 128] if self.fp8 else None)
        a1, s1 = x.to(torch.bfloat16).contiguous(), None
        if self.fp8:   # (newer launchers take pre-quantized A with its A_scale; 0.5.14 asks the stand-in)
            a1, s1 = quant_fp8_groups(a1)
            register_fp8(a1, s1)

        def gemm1():
            self.peer.invoke(a1, self.w1, None, cache1, s1, self.w1_scale, None, tw, ids, sorted_ids,
                             expert_ids, post, False, k, up, **common)
        gemm1()
        g = cache1.float()
        a2 = (torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]).to(torch.bfloat16).contiguous()
        s2 = None
        del g
        if self.fp8:
            a2, s2 = quant_fp8_groups(a2)
            register_fp8(a2, s2)

        def gemm2():
            self.peer.invoke(a2, self.w2, None, cache3, s2, self.w2_scale, None, tw, ids, sorted_ids,
                             expert_ids, post, True, 1, down, **common)
        gemm2()

        def run():
            gemm1()
            gemm2()
        return run, cache3.float().sum(1).to(torch.bfloat16)
