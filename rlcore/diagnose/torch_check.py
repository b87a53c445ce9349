"""The ``torch`` check: the installed torch, CUDA and its devices, gloo and NCCL, against ``resources.use_gpu``.
torch is imported inside the check only."""

from __future__ import annotations

from collections import Counter

from rlcore.diagnose.base import Check, Context, register


@register("torch")
def check_torch(ctx: Context) -> Check:
    import torch
    import torch.distributed as dist

    use_gpu = ctx.cfg.resources.use_gpu
    if not dist.is_available():
        return Check("torch", "fail", f"{torch.__version__}: built without torch.distributed",
                     "install a torch wheel from pytorch.org (the workers form gloo/nccl groups)")
    if not torch.cuda.is_available():
        build = f", a CUDA {torch.version.cuda} build but no GPU visible" if torch.version.cuda else ""
        detail = f"{torch.__version__}, CUDA: no (CPU only{build}); gloo: {'yes' if dist.is_gloo_available() else 'no'}"
        if use_gpu:
            return Check("torch", "fail", detail + "; resources.use_gpu asks for GPUs",
                         "set resources.use_gpu: false, or run where nvidia-smi lists GPUs with a CUDA build "
                         "of torch")
        if not dist.is_gloo_available():
            return Check("torch", "fail", detail, "install a torch wheel with gloo (the CPU workers need it)")
        return Check("torch", "ok", detail)
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    devices = ", ".join(f"{n} x {name}" for name, n in names.items())
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    detail = f"{torch.__version__}, CUDA {torch.version.cuda or torch.version.hip}: {devices}; NCCL: {nccl or 'no'}"
    if use_gpu and nccl is None:
        return Check("torch", "fail", detail, "install a torch CUDA wheel with NCCL (GPU workers use nccl groups)")
    if not use_gpu:
        detail += "; resources.use_gpu is false (training runs on the CPU)"
    return Check("torch", "ok", detail)
