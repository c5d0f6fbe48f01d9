"""benchmarks/train_e2e.py on the CPU: a few training steps of a tiny Qwen3-MoE with the native
and the MoK experts. Catches: implementations that start from different weights or see different
batches (their first losses would differ), MoK experts whose gradients do not reach the optimizer
(the curves would part within a few steps), a report or plot that is not written."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_e2e.py"


@pytest.fixture
def script(monkeypatch):
    """The script as the module `train_e2e` (importable by name: spawned ranks import it)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("train_e2e")


def test_native_and_mok_experts_train_alike(script, tmp_path):
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "15", "--warmup", "1"]
    # The CPU sizes, also where a GPU would make the script default to larger ones.
    args += ["--layers", "4", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32"]
    args += ["--batch", "4", "--seq", "32", "--lr", "3e-3", "--out", str(tmp_path)]
    assert script.main(args) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    native, ours = report["results"]["eager"], report["results"]["mok"]
    assert ours["losses"][0] == pytest.approx(native["losses"][0], abs=1e-2)
    # The loss falls, and the two runs stay within bf16 noise of each other.
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05
    assert (tmp_path / "train-e2e.md").read_text().count("| mok |") == 1
    assert (tmp_path / "train-e2e.png").read_bytes().startswith(b"\x89PNG")
    # The routing's skew per layer (max / mean pairs an expert takes: >= 1, and at most 8, all
    # pairs on one of the 8 experts), recorded whichever experts implementation runs.
    for run in (native, ours):
        assert len(run["expert_load"]) == 4
        assert all(1.0 <= load <= 8.0 for load in run["expert_load"])


@pytest.mark.parametrize("fp8", ["mok-mxfp8", "mok-fp8-block"])
def test_fp8_experts_train_alike(script, tmp_path, fp8):
    """`--implementations eager,mok,<fp8>` (MXFP8, the 128-block recipe): the FP8 run's loss
    falls and stays within a few e4m3 roundings of the native run's, and differs from the bf16
    MoK run's (catches the precision not reaching the layer: the two MoK runs would be
    identical)."""
    args = ["--device", "cpu", "--implementations", f"eager,mok,{fp8}", "--steps", "12"]
    args += ["--warmup", "1", "--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    # 12 steps of 4 sequences: the loss falls ~0.35 (8 steps of 2 fell 0.04-0.1, too close).
    args += ["--moe-intermediate", "32", "--batch", "4", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "train-e2e.json").read_text())["results"]
    bf16, ours = results["mok"], results[fp8]
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.1
    assert ours["losses"] != bf16["losses"]


def test_expert_parallel_training_follows_the_one_process_run(script, tmp_path):
    """EP 2 on gloo ranks (experts sharded, other gradients averaged): `mok` and `mok-baseline`
    follow the one-process run on the union of the ranks' batches. Catches: gradients of the
    replicated parameters not averaged (or experts' averaged twice), a rank's experts not sliced
    to its own, the ranks' batches overlapping."""
    sizes = ["--layers", "4", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    sizes += ["--moe-intermediate", "32", "--steps", "12", "--warmup", "1", "--seq", "32"]
    sizes += ["--lr", "3e-3", "--device", "cpu"]
    one = tmp_path / "one"
    assert script.main([*sizes, "--batch", "4", "--implementations", "mok", "--out", str(one)]) == 0
    two = tmp_path / "two"
    assert script.main([*sizes, "--batch", "2", "--ep", "2", "--out", str(two)]) == 0
    reference = json.loads((one / "train-e2e.json").read_text())["results"]["mok"]["losses"]
    results = json.loads((two / "train-e2e.json").read_text())["results"]
    assert list(results) == ["mok-baseline", "mok"]
    for result in results.values():
        assert max(abs(a - b) for a, b in zip(result["losses"], reference, strict=True)) < 0.05


def eager_and_compiled_results(script, tmp_path, args: list[str]) -> tuple[dict, dict]:
    """The script's results by implementation for `args`, run eagerly, then compiled by
    aot_eager."""
    assert script.main([*args, "--out", str(tmp_path / "eager")]) == 0
    assert script.main([*args, "--compile", "aot_eager", "--out", str(tmp_path / "compiled")]) == 0
    eager, compiled = (
        json.loads((tmp_path / run / "train-e2e.json").read_text())["results"]
        for run in ("eager", "compiled")
    )
    return eager, compiled


def test_compiled_expert_parallel_training_follows_the_eager_run(script, tmp_path):
    """EP 2 on gloo ranks with --compile aot_eager, the CPU's MoK layer on the reference backend
    inside the custom ops (its collectives and autograd graph off the op's thread): the losses are
    the eager run's. Catches Dynamo tracing into the layer's eager Python (it failed on the
    group's handle, an object Dynamo cannot read), and a compiled backward without the forward's
    graph, which ended the run."""
    args = ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--steps", "3", "--warmup", "1", "--seq", "16"]
    args += ["--batch", "2", "--ep", "2", "--implementations", "mok", "--device", "cpu"]
    eager, compiled = eager_and_compiled_results(script, tmp_path, args)
    assert compiled["mok"]["losses"] == eager["mok"]["losses"]


def test_gradient_accumulation_steps(script, tmp_path):
    """--accumulate 2: two micro-batches a step, their mean loss reported, both sets of
    implementations training alike. Catches the loss summed instead of averaged (the first loss
    would be ~2 ln 512 instead of ~ln 512 = 6.24) and tokens/s that leave the micro-batches out
    (the layer's accumulation of gradients over micro-batches: tests/test_grad_accumulation.py)."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "8", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--accumulate", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "train-e2e.json").read_text())["results"]
    native, ours = results["eager"], results["mok"]
    assert native["losses"][0] == pytest.approx(6.24, abs=0.3)
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05
    median_s = ours["median_ms"] / 1e3
    assert ours["tokens_per_s"] == pytest.approx(2 * 2 * 32 / median_s)


def test_mixed_precision_with_fp32_weights(script, tmp_path):
    """--weights fp32-autocast: fp32 weights, every step under autocast to bf16 (a trainer's bf16
    mode), MoK against the native experts alike. Catches the option not reaching the model
    (the report would say bf16 weights were trained) or MoK failing on fp32 experts."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "8", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--weights", "fp32-autocast", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    assert report["args"]["weights"] == "fp32-autocast"
    assert "fp32-autocast weights" in (tmp_path / "train-e2e.md").read_text()
    ours = report["results"]["mok"]
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05


def test_torchtitan_model_trains_alike_with_mok_behind_its_experts(script, tmp_path):
    """--framework torchtitan: TorchTitan's own Qwen3-MoE (its debug flavor cut to two layers;
    eager causal attention on the CPU) against itself with MoK behind its routed experts.
    Catches use_mok not taking effect (the report would show TorchTitan's path twice: equal
    curves are then no test, so the mok model is checked to route through MoK), its experts'
    gradients not reaching the optimizer (the curves would part), the report's MoE shape
    taken from the wrong module."""
    pytest.importorskip("torchtitan")
    from mok.integrations.torchtitan import missing_torch_features

    if missing := missing_torch_features():
        pytest.skip(f"TorchTitan's models need {', '.join(missing)} (a newer PyTorch)")
    args = ["--device", "cpu", "--framework", "torchtitan", "--titan-flavor", "debugmodel_moe"]
    args += ["--layers", "2", "--steps", "16", "--warmup", "1", "--batch", "4", "--seq", "32"]
    args += ["--lr", "1e-3", "--out", str(tmp_path)]
    assert script.main(args) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    native, ours = report["results"]["torchtitan"], report["results"]["mok"]
    assert ours["losses"][0] == pytest.approx(native["losses"][0], abs=1e-2)
    # A noisy curve at this size: the last four steps against the first four.
    assert sum(ours["losses"][-4:]) / 4 < sum(ours["losses"][:4]) / 4 - 0.1
    assert ours["max_loss_difference"] < 0.05
    assert ours["losses"] != native["losses"]  # two implementations, not one twice
    assert report["args"]["experts"] == 64 and report["args"]["top_k"] == 8


def test_compiled_training_follows_the_eager_run(script, tmp_path):
    """--compile aot_eager: every implementation compiled from the second step on (MoK's
    experts need the first, eager, to make their workspaces). aot_eager keeps every operation,
    so the native run's losses must equal the eager run's exactly, and MoK's follow them.
    Catches the compiled model not being the one trained (its losses would stay at the first
    step's), a compile before the workspaces exist (the run would raise)."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "6", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "16", "--lr", "3e-3"]
    eager, compiled = eager_and_compiled_results(script, tmp_path, args)
    assert compiled["eager"]["losses"] == eager["eager"]["losses"]
    assert compiled["mok"]["max_loss_difference"] < 0.05
    assert compiled["mok"]["losses"][-1] < compiled["mok"]["losses"][0]


def test_under_torchrun_the_ranks_join_its_job(script, tmp_path):
    """`torchrun --nproc-per-node 2 benchmarks/train_e2e.py --ep 2`: the script joins torchrun's
    job instead of spawning ranks, rank 0 alone writes the report, and the losses are the
    spawned run's. Catches a second set of ranks spawned inside the job (it would hang or
    fail), every rank writing the same files, ranks that train on the same batch."""
    import os
    import subprocess
    import sys

    args = ["--device", "cpu", "--ep", "2", "--layers", "2", "--hidden", "64", "--experts", "8"]
    args += ["--top-k", "2", "--moe-intermediate", "32", "--steps", "5", "--warmup", "1"]
    args += ["--batch", "2", "--seq", "16", "--lr", "3e-3"]
    assert script.main([*args, "--out", str(tmp_path / "spawned")]) == 0
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(SCRIPT), *args, "--out", str(tmp_path / "torchrun")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("| mok |") == 1  # one report, rank 0's
    spawned, joined = (
        json.loads((tmp_path / run / "train-e2e.json").read_text())["results"]
        for run in ("spawned", "torchrun")
    )
    for name in ("mok-baseline", "mok"):
        pairs = zip(joined[name]["losses"], spawned[name]["losses"], strict=True)
        assert max(abs(a - b) for a, b in pairs) < 1e-3, name


def test_balanced_routing_trains_alike(script, tmp_path):
    """--routing balanced through the whole script: both implementations train alike, the
    report says which routing ran. Catches the option not reaching the models (the label) or
    a balanced choice that breaks training (the loss would not fall)."""
    args = ["--device", "cpu", "--implementations", "eager,mok", "--steps", "10", "--warmup", "1"]
    args += ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "4", "--seq", "64", "--lr", "3e-3"]
    assert script.main([*args, "--routing", "balanced", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train-e2e.json").read_text())
    native, ours = report["results"]["eager"], report["results"]["mok"]
    assert native["expert_load"] == ours["expert_load"]
    assert ours["losses"][-1] < ours["losses"][0] - 0.1
    assert ours["max_loss_difference"] < 0.05
    assert "routing: balanced" in (tmp_path / "train-e2e.md").read_text()


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_balanced_routing_reaches_the_experts(script, arch):
    """Every router of the model routes by its table: the experts see exactly the table's
    loads, k distinct experts a token, weighted by the router's own scores at them, normalised
    and scaled as the router does.
    Catches a router family the option misses (the loads would be the model's own) and weights
    gathered from other experts than the chosen ones."""
    import torch
    import transformers

    args = script.build_parser().parse_args(
        ["--device", "cpu", "--arch", arch, "--layers", "2", "--hidden", "64", "--experts", "8"]
        + ["--top-k", "2", "--moe-intermediate", "32", "--batch", "2", "--seq", "64"]
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(script.model_config(args))
    assert script.balance_routing(model, tokens=128, seed=0) == 2
    tokens = torch.randint(0, script.VOCAB, (2, 65))
    routed = []
    for module in model.modules():
        if type(module).__name__.lower().endswith("router"):
            module.register_forward_hook(lambda m, i, out: routed.append((m, *out)))
    loads = script.expert_load(model, tokens, experts=8)
    tables = [router.balanced_choice for router, *_ in routed]
    expected = [(c.flatten().bincount(minlength=8).max() / 32).item() for c in tables]
    assert loads == pytest.approx(expected, abs=0)
    for router, logits, weights, indices in routed:
        assert torch.equal(indices, router.balanced_choice)
        assert all(len(set(row.tolist())) == 2 for row in indices)
        # Each family's own scoring: softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3),
        # normalised where the router normalises (Mixtral always), times DeepSeek-V3's scale.
        scores = logits.float().sigmoid() if arch == "deepseek-v3" else logits.float().softmax(-1)
        expected = scores.gather(1, indices)
        if arch == "mixtral" or router.norm_topk_prob:
            expected = expected / expected.sum(-1, keepdim=True)
        expected = expected * getattr(router, "routed_scaling_factor", 1.0)
        torch.testing.assert_close(weights, expected.to(weights.dtype))


def test_balanced_routing_weights_are_the_routers_scores(script):
    """The balanced router's weights are its own softmax scores at the chosen experts,
    normalised as the router normalises, and the gradient reaches the router's weight. Catches
    weights gathered from the wrong experts or left unnormalised, and a table applied to a batch
    of another size."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    )
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    assert script.balance_routing(torch.nn.Sequential(router), tokens=16, seed=0) == 1
    hidden = torch.randn(16, 32)
    logits, weights, indices = router(hidden)
    assert torch.equal(indices, router.balanced_choice)
    expected = (hidden @ router.weight.T).softmax(-1).gather(1, indices)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))
    weights.pow(2).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="choice for 16 tokens, not 8"):
        router(hidden[:8])


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_optimizer_is_the_named_adamw(script, implementation):
    """--optimizer builds AdamW in the implementation it names, over every parameter at --lr,
    and the report says which. Catches the option ignored (PyTorch's default, foreach on GPUs,
    timed under a report that says fused) and parameters left out of the optimizer."""
    import torch

    args = script.build_parser().parse_args(
        ["--device", "cpu", "--optimizer", implementation, "--lr", "0.01"]
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = script.make_optimizer(model, args)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults[implementation] is True
    other = "foreach" if implementation == "fused" else "fused"
    assert not optimizer.defaults[other]
    assert optimizer.defaults["lr"] == 0.01
    (group,) = optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    assert script.build_parser().parse_args([]).optimizer == "fused"
    header = {"date": "d", "commit": "c", "machine": "m", "command": "x"}
    assert f"AdamW ({implementation})" in script.markdown(args, {}, header)


def test_an_implementation_named_twice_runs_twice_and_repeats_exactly(script, tmp_path):
    """`--implementations mok,mok --deterministic`: two runs, the second reported as "mok #2",
    with the same losses bit for bit (the CPU is deterministic anyway: this catches the second
    run overwriting the first, a run that does not start from the same weights and batches, and
    the deterministic mode leaking out of the script)."""
    import torch

    args = ["--device", "cpu", "--implementations", "mok,mok", "--deterministic", "--steps", "3"]
    args += ["--warmup", "1", "--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "2", "--seq", "16", "--out", str(tmp_path)]
    assert script.main(args) == 0
    results = json.loads((tmp_path / "train-e2e.json").read_text())["results"]
    assert list(results) == ["mok", "mok #2"]
    assert results["mok #2"]["losses"] == results["mok"]["losses"]
    assert results["mok #2"]["same_losses_as_first"]
    report = (tmp_path / "train-e2e.md").read_text()
    assert "Losses bit for bit those of mok: mok #2" in report
    assert "Repeated runs against their implementation's first: mok #2 bit for bit" in report
    assert "deterministic algorithms: on" in report
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_router_epilogue_trains_alike(script, tmp_path):
    """`--implementations mok,mok-router-epilogue`: the run with `router_gradient="epilogue"`
    follows the plain one within bf16 noise, and is not the same run (catches the option not
    reaching the layers through the adapter: the two runs would be identical)."""
    args = ["--device", "cpu", "--implementations", "mok,mok-router-epilogue", "--steps", "8"]
    args += ["--warmup", "1", "--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2"]
    args += ["--moe-intermediate", "32", "--batch", "4", "--seq", "32", "--lr", "3e-3"]
    assert script.main([*args, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "train-e2e.json").read_text())["results"]
    plain, epilogue = results["mok"], results["mok-router-epilogue"]
    assert epilogue["losses"][-1] < epilogue["losses"][0] - 0.1
    assert epilogue["max_loss_difference"] < 0.02
    assert epilogue["losses"] != plain["losses"]
