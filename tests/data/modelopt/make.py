# SPDX-License-Identifier: Apache-2.0
"""Regenerate this folder with NVIDIA ModelOpt itself (not run in CI: ModelOpt's dependencies are heavy).

    pip install --target SITE nvidia-modelopt==0.47.0 --no-deps
    pip install --target SITE omegaconf antlr4-python3-runtime==4.9.3 pulp scipy nvidia-ml-py
    PYTHONPATH=SITE:. python tests/data/modelopt/make.py QUANTIZE_DRAFTER_PY   # everything
    PYTHONPATH=SITE:. python tests/data/modelopt/make.py --inputs              # inputs.safetensors only

QUANTIZE_DRAFTER_PY is examples/speculative_decoding/scripts/quantize_drafter.py from
NVIDIA/Model-Optimizer PR #2027. It runs on CPU. source.safetensors holds a few bf16 weights shaped like
a drafter's; each <qformat>.safetensors is ModelOpt's export of them, read by tests/checkpoint/test_modelopt.py.

inputs.safetensors holds activations ``x`` and ModelOpt's own quantize-dequantize of them, as each
of its formats quantizes a linear's input on CPU: ``fp8`` (FP8: static per tensor, calibrated on x by
max), ``fp8_pc_pt`` (per token, dynamic) and ``nvfp4`` (NVFP4QTensor under the global scale calibrated on x:
its fake quantizer for inputs is CUDA-only), with the ``input_scale`` each export stores (``NAME_input_scale``).
Read by tests/math/test_act_quant.py.

small.json is ModelOpt's export of the whole ``small`` preset (``make_random(..., "small", seed=0)``), per
qformat: its hf_quant_config and each tensor's dtype, shape and sha256 (``tensor_digest``). The drafter quantizer's steps run
one by one, with ModelOpt's own fused-layer preprocessing (``preprocess_linear_fusion``, what its unified
HF export applies to qkv and gate_up) over the layers vLLM fuses, whose shards share one scale.
"""

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).parent


def main(script: str) -> None:
    spec = importlib.util.spec_from_file_location("quantize_drafter", script)
    qd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qd)
    # The 0.47.0 wheel lacks the fp8_pc_pt alias the PR's base has.
    qd.QUANT_CFG_CHOICES.setdefault("fp8_pc_pt", qd.QUANT_CFG_CHOICES["fp8_per_channel_per_token"])
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    source = {
        "layers.0.mlp.gate_proj.weight": w(64, 64, scale=0.2),
        "layers.0.mlp.up_proj.weight": w(64, 64),
        "layers.0.mlp.down_proj.weight": w(64, 64),
        "layers.0.self_attn.q_b_proj.weight": w(32, 32),
        "layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "markov_head.markov_w2.weight": w(32, 16),
    }
    source["layers.0.mlp.down_proj.weight"][3] = 0  # an all-zero row
    save_file(source, HERE / "source.safetensors")
    for qformat in ("fp8", "fp8_pc_pt", "nvfp4", "w4a16_nvfp4"):
        src, out = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()) / "out"
        shutil.copy(HERE / "source.safetensors", src / "model.safetensors")
        (src / "config.json").write_text(json.dumps({"architectures": ["DSparkDraftModel"]}))
        sys.argv = ["quantize_drafter", "--drafter_path", str(src), "--qformat", qformat]
        sys.argv += ["--export_path", str(out)]
        qd.main()
        exported = load_file(out / "model.safetensors")
        save_file(
            {
                k: v
                for k, v in exported.items()
                if k.rsplit(".", 1)[0] + ".weight" in source or "scale" in k
            },
            HERE / f"{qformat}.safetensors",
        )
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        (HERE / f"{qformat}.json").write_text(json.dumps(config, indent=1) + "\n")
    _small(qd)
    _inputs()


def _inputs() -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.quant_utils import get_activation_scaling_factor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from tests.support.activations import activations

    x = activations(torch.bfloat16)
    found = {"x": x}
    configs = {
        "fp8": mtq.FP8_DEFAULT_CFG,
        "fp8_pc_pt": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    }
    for name, config in configs.items():
        linear = torch.nn.Sequential(torch.nn.Linear(384, 64, bias=False)).to(torch.bfloat16)
        mtq.quantize(linear, config, lambda model: model(x))  # calibrates static scales on x
        input_scale = get_activation_scaling_factor(linear[0])  # what the export stores
        if input_scale is not None:
            found[f"{name}_input_scale"] = input_scale.float().reshape(1)
        if name == "nvfp4":  # its input fake quantizer is CUDA-only: its quantizer's own math
            packed, scale, scale_2 = NVFP4QTensor.quantize(x, 16, None, input_scale)
            found[name] = packed.dequantize(
                dtype=torch.bfloat16, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
            )
        else:
            with torch.no_grad():
                found[name] = linear[0].input_quantizer(x)
    save_file(found, HERE / "inputs.safetensors")


def _small(qd) -> None:
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion
    from modelopt.torch.quantization import quantize

    from tests.support.checkpoints import tensor_digest
    from vllm_dspark.checkpoint.layout import fused_module_groups
    from vllm_dspark.checkpoint_tools.make_random import make_random

    drafter = Path(tempfile.mkdtemp()) / "small"
    make_random(drafter, "small", seed=0, progress=False)
    _, state_dict = qd.load_drafter(str(drafter))
    found = {}
    for qformat in ("fp8", "fp8_pc_pt", "nvfp4", "w4a16_nvfp4"):
        root = qd.build_linear_view(state_dict, torch.bfloat16)
        quant_cfg = qd.build_quant_cfg(qformat, [], False)
        quantize(root, quant_cfg)
        qd.resolve_activation_scales(root, quant_cfg)
        linears = dict(root.named_modules())
        quantized = [
            n
            for n, m in linears.items()
            if qd.is_quantized_linear(m) and m.weight_quantizer.is_enabled
        ]
        for members in fused_module_groups(quantized).values():
            preprocess_linear_fusion([linears[n] for n in members])
        exported = qd.export_quantized_state_dict(root, state_dict, torch.bfloat16)
        found[qformat] = {
            "hf_quant_config": qd.get_quant_config(root),
            "tensors": {k: tensor_digest(v) for k, v in sorted(exported.items())},
        }
    (HERE / "small.json").write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    _inputs() if sys.argv[1] == "--inputs" else main(sys.argv[1])
