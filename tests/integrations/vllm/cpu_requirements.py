"""Print the installed vLLM's requirements less what needs CUDA, one per line, for ``pip install -r``.

vLLM 0.33 has no CPU build: ``make test-vllm033`` installs its wheel without dependencies, then these,
beside the CPU build of torch, so that its Python code (the connector API, the real Scheduler) runs here.
"""

from __future__ import annotations

import importlib.metadata
import re

# torch and its companions come as the CPU build; the rest are CUDA kernels and their runtimes.
CUDA_ONLY = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|"
                       r"nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming)", re.IGNORECASE)


def main() -> None:
    for requirement in importlib.metadata.requires("vllm") or []:
        if "extra ==" not in requirement and not CUDA_ONLY.match(requirement):
            print(requirement)


if __name__ == "__main__":
    main()
