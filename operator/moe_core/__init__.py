"""The shared vocabulary of both planes: pydantic and the standard library only.

No torch, no Kubernetes client, no kopf: the operator (control plane), the runtime (data plane)
and the kernels all import these modules, so each fact is written once:

  formats   checkpoint format -> expert weight format, FP4 or not, which engines/backends load it
  gpu       GPU families and products, GPU classes from node labels
  checkpoint  checkpoint facts: classification, safetensors header reading, config keys/defaults
  registry  the MoE kernel-backend capability registry (data; `moe_kernels` instantiates)
  runtime   what the bundled runtime can serve (architectures, formats, parallelism)
  plan      the Plan schema (operator -> pod, as plan.json)
  bundled   resolve_bundled(): the one bundled-backend decision, planner and runtime alike
"""
