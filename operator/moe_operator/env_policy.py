"""Which env names a MoEDeployment may set, by class of harm. Pure; the one source of truth for the
CRD's CEL rules (api.py) and the pydantic model that the webhook and the reconcile validate with.

An allowed image runs only the code the image holds, and a labelled token goes only where the
operator sends it, unless the env says otherwise. Refused:
- LOADS_CODE: names that make an interpreter, the loader or a compiler run code from elsewhere
  (a tenant's volume): PYTHONPATH and every PYTHON* but a short list of harmless ones, LD_*,
  PATH, HOME (the Python user site under it), shell startup files, the compilers Triton calls.
- CACHE_DIRS: where engines keep compiled kernels; the operator mounts them at fixed paths, so a
  tenant can neither choose where a writable node directory lands nor read kernels from its volume.
- GPU_ACCESS: what widens the container runtime's GPU or driver grant.
- OPERATOR_OWNED: what the operator sets itself (hub endpoint and client settings, the pinned
  revision, offline mode, rendezvous): a second value would silently lose or override it.
- REDIRECTS_HUB (beside model.tokenSecretRef, any case, as curl and requests read both): proxies and
  CA bundles; with them the hub client sends the token's Bearer header to another host.
"""

from __future__ import annotations

GPU_ACCESS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
LOADS_CODE = ("PATH", "HOME", "BASH_ENV", "ENV", "GCONV_PATH", "PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB",
              "RUBYOPT", "NODE_OPTIONS", "NODE_PATH", "JAVA_TOOL_OPTIONS", "CC", "CXX", "TRITON_PTXAS_PATH",
              "TRITON_CUOBJDUMP_PATH", "TRITON_NVDISASM_PATH", "TRITON_LIBCUDA_PATH", "TRITON_LIBDEVICE_PATH",
              "CUDA_HOME", "CUDA_PATH", "ROCM_PATH", "HF_MODULES_CACHE")
CACHE_DIRS = ("SGLANG_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR",
              "TORCH_EXTENSIONS_DIR", "TORCH_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "XDG_CACHE_HOME",
              "XDG_CONFIG_HOME", "XDG_DATA_HOME", "CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE",
              "FLASHINFER_CUBIN_DIR", "DG_JIT_CACHE_DIR")
OPERATOR_OWNED = ("HF_ENDPOINT", "HF_HOME", "HF_TOKEN_PATH", "HF_REVISION", "HUGGING_FACE_HUB_TOKEN")
RESERVED_NAMES = GPU_ACCESS + LOADS_CODE + CACHE_DIRS + OPERATOR_OWNED
RESERVED_PREFIXES = ("LD_", "DYLD_", "NVIDIA_", "LWS_", "HF_HUB_", "HUGGINGFACE_")
# PYTHON* variables load modules (PYTHONPATH, PYTHONHOME, PYTHONUSERBASE, PYTHONSTARTUP, PYTHONBREAKPOINT,
# PYTHONPYCACHEPREFIX's bytecode, PYTHONWARNINGS' categories are imported): only these are harmless
PYTHON_ALLOWED = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "PYTHONHASHSEED",
                  "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONNOUSERSITE", "PYTHONOPTIMIZE", "PYTHONMALLOC")
REDIRECTS_HUB = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy", "socks_proxy",
                 "ssl_cert_file", "ssl_cert_dir", "requests_ca_bundle", "curl_ca_bundle", "aws_ca_bundle",
                 "grpc_default_ssl_roots_file_path", "node_extra_ca_certs", "openssl_conf")


def refusal(name: str) -> str | None:
    """Why `name` may not be set by a MoEDeployment at all, or None."""
    if name in GPU_ACCESS or name.startswith(("NVIDIA_",)):
        return f"env {name} is reserved: it widens the container's GPU or driver access"
    if name in CACHE_DIRS:
        return f"env {name} is reserved: engine cache directories are mounted by the operator at fixed paths"
    if name in OPERATOR_OWNED or name.startswith(("HF_HUB_", "HUGGINGFACE_", "LWS_")):
        return f"env {name} is reserved: the operator sets it (hub endpoint and client, pinned revision, rendezvous)"
    if name in LOADS_CODE or name.startswith(("LD_", "DYLD_")) or (name.startswith("PYTHON") and name not in PYTHON_ALLOWED):
        return f"env {name} is reserved: it loads code into the engine from outside its image"
    return None


def token_refusal(name: str) -> str | None:
    """Why `name` may not be set beside model.tokenSecretRef, or None."""
    if name.lower() in REDIRECTS_HUB:
        return (f"env {name} is refused beside model.tokenSecretRef: a proxy or CA bundle would let the hub "
                "client send the token to another host")
    if name == "HF_TOKEN":
        return "env HF_TOKEN collides with model.tokenSecretRef (the operator sets HF_TOKEN from that Secret)"
    return None


def _list(values) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def cel_item_rules() -> list[tuple[str, str]]:
    """(rule, message) on one env item (`self` is the EnvVar), the same classes as refusal()."""
    return [
        ("!(self.name in " + _list(GPU_ACCESS) + ") && !self.name.startsWith('NVIDIA_')",
         "env name is reserved: it widens the container's GPU or driver access"),
        ("!(self.name in " + _list(CACHE_DIRS) + ")",
         "env name is reserved: engine cache directories are mounted by the operator at fixed paths"),
        ("!(self.name in " + _list(OPERATOR_OWNED) + ") && "
         + " && ".join(f"!self.name.startsWith('{p}')" for p in ("HF_HUB_", "HUGGINGFACE_", "LWS_")),
         "env name is reserved: the operator sets it (hub endpoint and client, pinned revision, rendezvous)"),
        ("!(self.name in " + _list(LOADS_CODE) + ") && !self.name.startsWith('LD_') && !self.name.startsWith('DYLD_')"
         " && (!self.name.startsWith('PYTHON') || self.name in " + _list(PYTHON_ALLOWED) + ")",
         "env name is reserved: it loads code into the engine from outside its image"),
    ]


def cel_token_rule() -> tuple[str, str]:
    """(rule, message) on the spec: no hub redirect beside a token."""
    return ("!has(self.model.tokenSecretRef) || !has(self.env) || !self.env.exists(e, e.name.lowerAscii() in "
            + _list(REDIRECTS_HUB) + ")",
            "env proxy and CA-bundle variables (" + ", ".join(n.upper() for n in REDIRECTS_HUB[:4])
            + ", SSL_CERT_FILE, ...) are refused beside model.tokenSecretRef: they would let the hub client "
            "send the token to another host")
