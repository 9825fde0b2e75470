# SPDX-License-Identifier: Apache-2.0
"""The drift harness end to end on the tiny and small presets, on CPU (and on CUDA where there is one).

What must hold whatever the (random) weights: a second, independently loaded FP32 reference is exact, BF16
drifts less than FP8, which drifts less than the 4-bit formats, and the CLI writes its report.
"""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm_dspark.drift import corpus, regimes
from vllm_dspark.drift.harness import EvalSpec, backbone, batches, make_blocks, run
from vllm_dspark.drift.variants import load_reference
from vllm_dspark.reference.target import load_target
from vllm_dspark.tools import cli
from vllm_dspark.tools.eval import main, parse_position


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    from vllm_dspark.checkpoint_tools.make_random import make_random

    return make_random(tmp_path_factory.mktemp("small_checkpoint"), "small", seed=0, progress=False)


def _cell(results, variant, regime, position=None):
    position = results["config"]["positions"][0] if position is None else position
    (cell,) = [
        c
        for c in results["cells"]
        if (c["variant"], c["regime"], c["position"]) == (variant, regime, position)
    ]
    return cell["metrics"]


def test_second_fp32_reference_is_exact(tiny_checkpoint):
    """Agreement 1 and KL 0 in every regime, also far into the YaRN range."""
    spec = EvalSpec(
        model=str(tiny_checkpoint),
        variants=("fp32",),
        blocks=12,
        batch_size=5,
        context_len=8,
        positions=(1 << 17,),
        resamples=50,
        progress=False,
    )
    results = run(spec)
    assert "loaded independently" in results["config"]["variant_sources"]["fp32"]
    assert results["config"]["positions"] == [8, 1 << 17]
    assert len(results["cells"]) == 3 * 2
    for cell in results["cells"]:
        m = cell["metrics"]
        for key in ("greedy_agreement", "rollout_agreement", "one_minus_tv"):
            assert m[key]["value"] == pytest.approx(1.0, abs=1e-12), (cell["regime"], key)
        for key in ("kl_mean", "kl_p99", "reverse_kl_mean", "sched_flip_rate"):
            assert m[key]["value"] == 0.0, (cell["regime"], key)
        assert m["confidence_r"]["value"] == pytest.approx(1.0)
        assert m["ceiling"]["value"] == pytest.approx(8.0) and m["prefix_length"][
            "value"
        ] == pytest.approx(8.0)


def _at_least(a, b):
    """``a >= b`` on the point estimates, or within the CIs."""
    return a["value"] >= b["value"] or a["hi"] >= b["lo"]


def test_precision_ordering_on_the_small_preset(small_checkpoint):
    """BF16 >= FP8 >= each 4-bit format in agreement and ceiling."""
    spec = EvalSpec(
        model=str(small_checkpoint),
        variants=("bf16", "fp8", "mxfp4", "nvfp4"),
        regimes=("heavy",),
        blocks=48,
        batch_size=16,
        resamples=200,
        progress=False,
    )
    results = run(spec)
    m = {v: _cell(results, v, "heavy") for v in spec.variants}
    for key in ("greedy_agreement", "rollout_agreement", "one_minus_tv", "ceiling", "ceiling_tv"):
        assert _at_least(m["bf16"][key], m["fp8"][key]), key
        for four_bit in ("mxfp4", "nvfp4"):
            assert _at_least(m["fp8"][key], m[four_bit][key]), (key, four_bit)
    assert (
        m["bf16"]["kl_mean"]["value"]
        < m["fp8"]["kl_mean"]["value"]
        < min(m["mxfp4"]["kl_mean"]["value"], m["nvfp4"]["kl_mean"]["value"])
    )
    # The quantized builds drift; a harness that scored them as exact would be broken.
    assert m["fp8"]["greedy_agreement"]["value"] < 1.0


@pytest.mark.gpu
def test_eval_on_cuda_agrees_with_cpu_cell_by_cell(small_checkpoint):
    """``eval --device cuda`` (GPU kernels, BF16 on tensor cores) scores every cell as the CPU does:
    each headline figure lies within the other device's 95 % CI."""
    spec = EvalSpec(
        model=str(small_checkpoint),
        variants=("bf16", "fp8", "mxfp4", "nvfp4"),
        blocks=64,
        batch_size=32,
        progress=False,
    )
    cuda, cpu = run(replace(spec, device="cuda")), run(spec)
    cells = [(c["variant"], c["regime"]) for c in cpu["cells"]]
    assert len(cells) == 12 and cells == [(c["variant"], c["regime"]) for c in cuda["cells"]]
    for variant, regime in cells:
        for key in ("greedy_agreement", "ceiling", "kl_mean"):
            a, b = _cell(cuda, variant, regime)[key], _cell(cpu, variant, regime)[key]
            inside = a["lo"] <= b["value"] <= a["hi"] or b["lo"] <= a["value"] <= b["hi"]
            assert inside, (variant, regime, key, a, b)


def test_cli_writes_results_table_and_plots(tiny_checkpoint, tmp_path):
    out = tmp_path / "results"
    rc = main(
        [
            "--model",
            str(tiny_checkpoint),
            "--variants",
            "fp32",
            "bf16",
            "fp8",
            "nvfp4",
            "--blocks",
            "6",
            "--batch-size",
            "4",
            "--context-len",
            "8",
            "--positions",
            "1k",
            "128k",
            "--resamples",
            "40",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["variants"] == ["fp32", "bf16", "fp8", "nvfp4"]
    assert results["config"]["positions"] == [8, 1024, 131072]
    assert len(results["cells"]) == 4 * 3 * 3
    assert {"torch", "vllm_dspark", "compressed_tensors"} <= set(results["versions"])
    assert results["config"]["seed"] == 0 and "methodology" in results
    table = (out / "results.md").read_text()
    assert "| fp8 |" in table and "Ceiling τ" in table and "128k" in table
    for name in ("agreement_per_position.png", "ceiling.png", "kl_tails.png", "position_sweep.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_cli_rejects_bad_input(tiny_checkpoint, tmp_path, capsys):
    assert (
        cli.main(
            [
                "eval",
                "--model",
                str(tiny_checkpoint),
                "--variants",
                "int3",
                "--blocks",
                "4",
                "--regimes",
                "gauss",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "unknown variant" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "eval",
                "--model",
                str(tiny_checkpoint),
                "--variants",
                "bf16",
                "--blocks",
                "4",
                "--regimes",
                "gauss",
                "--positions",
                "2M",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "out of range" in capsys.readouterr().err


def test_quantized_checkpoint_directory_matches_the_on_the_fly_format(tiny_checkpoint, tmp_path):
    """A directory written by `vllm-dspark quantize` scores exactly like the same format made on the fly."""
    from vllm_dspark.tools import quantize

    out = tmp_path / "ckpt-fp8"
    argv = ["--model-dir", str(tiny_checkpoint), "--output-dir", str(out), "--quant-format", "fp8"]
    assert quantize.main(argv) in (0, None)
    spec = EvalSpec(
        model=str(tiny_checkpoint),
        variants=("fp8", str(out)),
        regimes=("gauss",),
        blocks=8,
        batch_size=4,
        context_len=8,
        resamples=20,
        progress=False,
    )
    results = run(spec)
    on_the_fly, from_disk = _cell(results, "fp8", "gauss"), _cell(results, "ckpt-fp8", "gauss")
    for key in ("greedy_agreement", "kl_mean", "ceiling"):
        assert on_the_fly[key] == from_disk[key], key


# ----- inputs -----


@pytest.mark.parametrize("regime", ["heavy", "boot"])
def test_cell_inputs_are_pinned(tiny_checkpoint, regime):
    """Cell (regime, P), block b: context at positions P - T .. P - 1 holding block b's aux states, anchor the
    last token of b's corpus window, block at P .. P + N - 1, which is where the drafter puts a block after
    that context."""
    t, position = 8, 40000
    spec = EvalSpec(
        model=str(tiny_checkpoint),
        regimes=(regime,),
        blocks=5,
        batch_size=3,
        context_len=t,
        positions=(position,),
        progress=False,
    )
    config, reference, _ = load_reference(spec.model, target=spec.target)
    blocks = make_blocks(spec, config, reference)
    assert spec.all_positions() == [t, position]
    n, layers, width = config.draft_block_size, config.num_target_layers, config.target_hidden_size
    for p in spec.all_positions():
        cell = list(batches(spec, config, blocks, regime, p))
        assert [b.ids.tolist() for b in cell] == [[0, 1, 2], [3, 4]]
        for b in cell:
            rows = len(b.ids)
            assert torch.equal(b.context_positions, torch.arange(p - t, p).expand(rows, t))
            assert torch.equal(b.block_positions, torch.arange(p, p + n).expand(rows, n))
            assert torch.equal(b.anchors, blocks.windows[b.ids, t])
            expected_aux = (
                regimes.boot_aux(reference, blocks.windows[b.ids, :t], layers)
                if regime == "boot"
                else regimes.synthetic_aux(regime, b.ids.tolist(), t, layers, width, spec.seed)
            )
            assert torch.equal(b.aux, expected_aux)
    # What the harness scores is what the drafter drafts from those inputs.
    b = next(batches(spec, config, blocks, regime, position))
    hidden, _ = backbone(reference, b, absorbed=False)
    drafted = reference.draft(b.aux, b.context_positions, b.anchors)
    assert torch.equal(drafted.block_positions, b.block_positions)
    torch.testing.assert_close(hidden, drafted.hidden, atol=0, rtol=0)


def test_real_aux_is_the_residual_entering_the_layers_vllm_taps(dspark_models, tmp_path):
    """The real regime's aux states are what the target's layers ``target_layer_ids + 1`` receive
    (seen by hooks on those layers), in BF16, bit for bit; a heads-only target is refused in one line.

    The hooked target runs the harness's batches (``batch_size`` windows at a time), so both run the
    same FP32 GEMMs: all 3 windows at once round differently on some hosts (1 of 23,040 BF16 values
    off by an ulp on a Xeon with AVX-512), where hooks on layer ``i`` instead differ almost everywhere."""
    ids = np.random.default_rng(0).integers(4, 4000, size=200)
    (tmp_path / "ids.json").write_text(json.dumps(ids.tolist()))
    spec = EvalSpec(
        model=str(dspark_models["drafter"]),
        target=str(dspark_models["target"]),
        regimes=("real",),
        blocks=3,
        batch_size=2,
        context_len=12,
        corpus=str(tmp_path / "ids.json"),
        progress=False,
    )
    config, reference, _ = load_reference(spec.model, target=spec.target)
    blocks = make_blocks(spec, config, reference)
    model = load_target(
        spec.target, config.target_layer_ids, config.target_hidden_size, config.vocab_size
    )
    seen = {i: [] for i in config.target_layer_ids}
    for i in config.target_layer_ids:
        model.model.layers[i + 1].register_forward_pre_hook(
            lambda _m, args, kw, i=i: seen[i].append(
                kw.get("hidden_states", args[0] if args else None)
            ),
            with_kwargs=True,
        )
    with torch.inference_mode():
        for start in range(0, spec.blocks, spec.batch_size):
            model(blocks.windows[start : start + spec.batch_size, :12])
    expected = torch.cat([torch.cat(seen[i]) for i in config.target_layer_ids], -1)
    assert torch.equal(blocks.states["real"], expected.to(torch.bfloat16))
    heads_only = EvalSpec(**{**spec.__dict__, "target": str(dspark_models["drafter"] / "target")})
    with pytest.raises(ValueError, match="holds only the shared heads"):
        make_blocks(heads_only, config, reference)


def test_synthetic_aux_is_a_function_of_the_block_alone():
    together = regimes.synthetic_aux("heavy", [0, 1, 2], 4, 5, 8, seed=7)
    alone = regimes.synthetic_aux("heavy", [2], 4, 5, 8, seed=7)
    assert together.dtype == torch.bfloat16 and together.shape == (3, 4, 40)
    assert torch.equal(together[2], alone[0])
    assert not torch.equal(regimes.synthetic_aux("gauss", [2], 4, 5, 8, seed=7), alone)


def test_heavy_regime_has_heavy_channels():
    aux = regimes.synthetic_aux("heavy", list(range(8)), 16, 1, 512, seed=0).float()
    rms = aux.pow(2).mean(dim=(0, 1)).sqrt()
    assert (
        rms.max() / rms.median() > 20
    )  # lognormal sigma 1.5 over 512 channels: max ~ exp(1.5 * 3)


def test_boot_aux_is_causal(tiny_checkpoint):
    from vllm_dspark.reference.drafter import ReferenceDrafter

    drafter = ReferenceDrafter.from_pretrained(tiny_checkpoint)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    a, b = regimes.boot_aux(drafter, ids, 5), regimes.boot_aux(drafter, changed, 5)
    assert a.shape == (2, 12, 5 * 64)
    assert torch.equal(a[:, :7], b[:, :7])  # earlier tokens never see a later one
    assert not torch.equal(a[:, 7:], b[:, 7:])


def test_pick_layers_spans_the_depth():
    assert regimes.pick_layers(6, 5) == [1, 2, 3, 4, 5]  # 5 drafter layers: each layer's output
    assert regimes.pick_layers(3, 5)[-1] == 2 and len(regimes.pick_layers(3, 5)) == 5


def test_corpus_formats(tmp_path):
    ids, source = corpus.load_corpus(vocab_size=512)
    assert ids.max() < 256 and len(ids) > 4000 and "default" in source
    (tmp_path / "a.txt").write_text("1 2, 3\n4")
    (tmp_path / "b.json").write_text("[[5, 6], [7]]")
    np.save(tmp_path / "c.npy", np.array([[8, 9]]))
    assert corpus.load_corpus(tmp_path / "a.txt", vocab_size=10)[0].tolist() == [1, 2, 3, 4]
    assert corpus.load_corpus(tmp_path / "b.json", vocab_size=10)[0].tolist() == [5, 6, 7]
    assert corpus.load_corpus(tmp_path / "c.npy", vocab_size=10)[0].tolist() == [8, 9]
    with pytest.raises(ValueError, match="outside the drafter's vocabulary"):
        corpus.load_corpus(tmp_path / "b.json", vocab_size=6)
    (tmp_path / "d.txt").write_text("plain words")
    with pytest.raises(ValueError, match="--tokenizer"):
        corpus.load_corpus(tmp_path / "d.txt", vocab_size=10)


def test_window_starts_are_distinct_while_possible():
    starts = corpus.window_starts(100, 10, 50, seed=0)
    assert len(set(starts.tolist())) == 50 and starts.max() <= 90
    assert len(corpus.window_starts(20, 10, 50, seed=0)) == 50  # repeats once the stream runs out


def test_parse_position():
    assert [parse_position(s) for s in ("4096", "32k", "1M")] == [4096, 32768, 1 << 20]
    assert math.log2(parse_position("128K")) == 17


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-static", "nvfp4-w4a4"])
def test_on_the_fly_w8a8_and_w4a4_variants_are_their_builds(
    fmt: str, tiny_checkpoint, tmp_path
) -> None:
    """A format made on the fly quantizes the same inputs (not kv_b_proj's: vLLM absorbs it) with the
    same scheme and scale, over the same weights, as the quantizer's build of it."""
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint
    from vllm_dspark.drift.variants import load_variant

    build = tmp_path / fmt
    quantize_checkpoint(tiny_checkpoint, build, fmt, progress=False)
    config, reference, heads = load_reference(str(tiny_checkpoint))
    fly, _ = load_variant(fmt, str(tiny_checkpoint), config, heads, reference)
    built, _ = load_variant(str(build), str(tiny_checkpoint), config, heads, reference)
    quantized = 0
    for (name, ours), (_, theirs) in zip(fly.named_modules(), built.named_modules()):
        if hasattr(ours, "input_quant"):
            assert torch.equal(ours.weight, theirs.weight), name
            if ours.input_quant is None:
                assert theirs.input_quant is None, name
                continue
            quantized += 1
            (scheme, scale), (their_scheme, their_scale) = ours.input_quant, theirs.input_quant
            assert scheme == their_scheme and (scale is None) == (their_scale is None), name
            assert scale is None or float(scale) == float(their_scale), name
    assert quantized == 1 + 5 * config.num_hidden_layers  # context_proj; q_b, o, gate, up, down
    assert fly.layers[0].self_attn.kv_b_proj.input_quant is None
