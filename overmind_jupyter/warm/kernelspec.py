"""Installing and removing the warm kernelspec: ipykernel's own kernelspec plus the `overmind-warm`
provisioner stanza, so the kernel runs exactly as a plain one once it is forked."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .zygote import DEFAULT_PRELOAD

__all__ = ["DEFAULT_NAME", "PROVISIONER", "install", "kernel_dict", "uninstall"]

DEFAULT_NAME = "overmind-warm"
PROVISIONER = "overmind-warm"  # the entry point's name in the group jupyter_client.kernel_provisioners


def kernel_dict(*, preload: list[str] | tuple[str, ...] = DEFAULT_PRELOAD, display_name: str | None = None,
                python: str | None = None) -> dict[str, Any]:
    """The kernel.json of a warm kernelspec.

    Args:
        preload: modules the spare imports (see `WarmProvisioner.preload`).
        display_name: the name JupyterLab shows; by default says it is warm and what it preloads.
        python: the kernel's interpreter (default: this one); it must have overmind_jupyter installed.
    """
    from ipykernel.kernelspec import get_kernel_dict

    spec = get_kernel_dict()
    spec["argv"][0] = python or sys.executable
    spec["display_name"] = display_name or f"Python 3 (warm: {', '.join(preload) or 'ipykernel'})"
    spec.setdefault("metadata", {})["kernel_provisioner"] = {
        "provisioner_name": PROVISIONER, "config": {"preload": list(preload)}}
    return spec


def install(name: str = DEFAULT_NAME, *, preload: list[str] | tuple[str, ...] = DEFAULT_PRELOAD,
            display_name: str | None = None, user: bool = True, prefix: str | None = None,
            python: str | None = None) -> str:
    """Install the warm kernelspec `name`; returns its directory.

    Args:
        name: the kernelspec's name (what `KernelManager(kernel_name=...)` and JupyterLab use).
        preload: modules the spare imports.
        display_name: see `kernel_dict`.
        user: install for this user (`jupyter --data-dir`); otherwise into `prefix`
            (`sys.prefix` for this environment), or system-wide when neither is given.
        prefix: install into `PREFIX/share/jupyter/kernels`.
        python: the kernel's interpreter (default: this one).
    """
    import json

    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    staging = Path(tempfile.mkdtemp(prefix="overmind-warm-"))
    try:
        source = write_kernel_spec(staging / name)  # ipykernel's logos and kernel.json
        (Path(source) / "kernel.json").write_text(
            json.dumps(kernel_dict(preload=preload, display_name=display_name, python=python), indent=1))
        return KernelSpecManager().install_kernel_spec(source, name, user=user and not prefix, prefix=prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def uninstall(name: str = DEFAULT_NAME) -> str:
    """Remove the kernelspec `name` (wherever jupyter finds it first); returns the directory removed.

    Raises:
        KeyError: no kernelspec of that name is installed.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    try:
        return KernelSpecManager().remove_kernel_spec(name)
    except KeyError as exc:  # jupyter_client raises a bare KeyError(name) here
        raise KeyError(f"no kernelspec named {name!r}: `jupyter kernelspec list` shows what is installed") from exc
