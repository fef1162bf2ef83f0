"""Pieces of the SFT / DPO / RM / distillation loops that need no workers: every recipe of these
algorithms validates against its schema, recipe errors name the key, padding keeps pairs whole,
the batch stream stops after its epochs, and the arithmetic task's preference view."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rl_algos import cli
from rl_algos.data.arithmetic import ArithmeticDatasetSpec, arithmetic_records, generate_problems
from rl_algos.data.dataloader import StatefulDataLoader
from rl_algos.training import BatchStream, DataExhaustedError, mean_over_optimizer_steps, pad_to_multiple
from rl_core.config import ConfigError, load_validated_config
from rl_core.data import BatchedDataDict
from rl_envs.math_grader import extract_answer

REPO = Path(__file__).resolve().parents[3]
ALGORITHMS = ("sft", "dpo", "rm", "distill", "eval")
RECIPES = sorted(
    [p for p in (REPO / "apps" / "configs").glob("*.yaml") if p.name.split("_")[0] in ALGORITHMS]
    + [cli.packaged_recipe(name) for name in cli.packaged_recipes() if name.split("_")[0] in ALGORITHMS]
)


def _schema(recipe: Path) -> type:
    return cli.import_target(cli.SUBCOMMANDS[recipe.name.split("_")[0]].schema)  # type: ignore[no-any-return]


def test_each_algorithm_has_gpu_and_cpu_recipes() -> None:
    names = {p.name for p in RECIPES if p.parent.name == "configs"}
    for algorithm in ALGORITHMS:
        ours = [n for n in names if n.startswith(f"{algorithm}_")]
        assert f"{algorithm}_tiny_cpu.yaml" in ours, algorithm
        assert len(ours) >= 2, f"{algorithm}: no GPU-sized recipe in apps/configs"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_validates(recipe: Path) -> None:
    cfg = load_validated_config(recipe, _schema(recipe))
    name = recipe.name.split("_")[0]
    if name == "eval":
        assert cfg.eval.num_tests_per_prompt >= max(cfg.eval.pass_k)
    else:
        assert getattr(cfg, name).max_num_steps >= 1
    if "tiny_cpu" not in recipe.name:
        assert cfg.cluster.use_gpus, recipe.name


def test_dpo_and_rm_recipe_errors_name_the_key() -> None:
    dpo = cli.packaged_recipe("dpo_tiny_cpu.yaml")
    schema = _schema(dpo)
    with pytest.raises(
        ConfigError, match=re.escape("policy.reference_model: DPO compares against the reference policy")
    ):
        load_validated_config(dpo, schema, ["policy.reference_model=false"])
    with pytest.raises(
        ConfigError, match=re.escape("policy.sequence_packing.enabled: preference training keeps each")
    ):
        load_validated_config(dpo, schema, ["policy.sequence_packing.enabled=true"])
    with pytest.raises(
        ConfigError, match=re.escape("data.train: preference training needs chosen/rejected pairs")
    ):
        load_validated_config(dpo, schema, ["data.train.format=sft"])
    rm = cli.packaged_recipe("rm_tiny_cpu.yaml")
    with pytest.raises(
        ConfigError, match=re.escape("policy.model_class: a reward model is a sequence classifier")
    ):
        load_validated_config(rm, _schema(rm), ["policy.model_class=causal_lm"])
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'rm.max_num_step'")):
        load_validated_config(rm, _schema(rm), ["rm.max_num_step=3"])
    distill = cli.packaged_recipe("distill_tiny_cpu.yaml")
    with pytest.raises(ConfigError, match=r"policy.train_global_batch_size \(12\) must divide"):
        load_validated_config(distill, _schema(distill), ["policy.train_global_batch_size=12"])


def test_padding_keeps_pairs_whole() -> None:
    data = BatchedDataDict(
        input_ids=torch.arange(12).reshape(6, 2),
        sample_mask=torch.ones(6),
        is_chosen=torch.tensor([True, False] * 3),
    )
    padded = pad_to_multiple(data, 8, group_size=2)
    assert padded.size == 8
    assert padded["input_ids"][6:].tolist() == [[0, 1], [2, 3]]  # a copy of the first pair
    assert padded["is_chosen"].tolist() == [True, False] * 4
    assert padded["sample_mask"].tolist() == [1.0] * 6 + [0.0, 0.0]
    assert pad_to_multiple(data, 6, group_size=2) is data
    with pytest.raises(ValueError, match="multiples of the group size 2"):
        pad_to_multiple(data, 5, group_size=2)


def test_batch_stream_runs_the_epochs_then_stops() -> None:
    loader: StatefulDataLoader[int, list[int]] = StatefulDataLoader(list(range(5)), 2, list, seed=3)
    stream = BatchStream(loader, max_num_epochs=2)
    batches = [stream.next_batch() for _ in range(4)]  # 2 full batches per epoch (drop_last)
    for epoch in (batches[:2], batches[2:]):
        items = [item for batch in epoch for item in batch]
        assert len(items) == len(set(items)) == 4  # each epoch visits 4 distinct samples
    assert loader.epoch == 2
    with pytest.raises(DataExhaustedError, match="finished 2 epoch"):
        stream.next_batch()


def test_mean_over_optimizer_steps() -> None:
    metrics = mean_over_optimizer_steps({"num_steps": 2, "loss": [1.0, 3.0], "lr": [0.1, 0.1], "note": "x"})
    assert metrics == {"loss": 2.0, "lr": pytest.approx(0.1), "optimizer_steps": 2.0}


def test_arithmetic_preference_pairs_prefer_the_right_answer() -> None:
    spec = ArithmeticDatasetSpec(format="preference", num_samples=50, levels=[1, 2, 3, 4], seed=7)
    records = arithmetic_records(spec)
    problems = generate_problems(50, levels=[1, 2, 3, 4], seed=7)
    for record, problem in zip(records, problems, strict=True):
        assert record["prompt"] == problem.prompt
        assert record["chosen"] == problem.solution()
        assert extract_answer(str(record["chosen"])) == str(problem.answer)
        wrong = extract_answer(str(record["rejected"]))
        assert wrong is not None and wrong != str(problem.answer) and int(wrong) >= 0
        # Same worked steps up to the last one: only the result differs.
        assert str(record["rejected"]).rsplit(" = ", 1)[0] == str(record["chosen"]).rsplit(" = ", 1)[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["eval", "model.model_name=/no/such/model"],
            "rl eval: error: model.model_name: '/no/such/model' is not a",
        ),
        (
            ["sft", "~base_model", "policy.model_name=/no/such/model"],
            "rl sft: error: policy.model_name: '/no/such/model' is not a directory",
        ),
        (
            ["distill", "--config", "distill_tiny_cpu"],
            "rl distill: error: policy.model_name: 'results/models/",
        ),
    ],
)
def test_missing_model_is_a_one_line_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_run_loop_validates_and_stops_when_the_data_runs_out(tmp_path: Path) -> None:
    """The loop's schedule with the driver only (the steps here touch no workers): validation at
    the start, every `val_period` steps and at the last step, also when the epochs end early."""
    from rl_algos.training import LoopConfig, LoopState, PolicyRun, run_loop
    from rl_core.checkpoint import CheckpointConfig, CheckpointManager
    from rl_core.logging import Logger, LoggerConfig, read_metrics_jsonl

    loader: StatefulDataLoader[int, list[int]] = StatefulDataLoader(list(range(6)), 2, list, seed=0)
    logger = Logger(LoggerConfig(log_dir=str(tmp_path), console=False))
    run = PolicyRun(
        name="test",
        loop=LoopConfig(max_num_steps=100, max_num_epochs=2, val_period=4),
        config_to_save={},
        policy=None,  # type: ignore[arg-type]  # never used: no checkpoints, no export
        batches=BatchStream(loader, 2),  # type: ignore[arg-type]
        logger=logger,
        checkpointer=CheckpointManager(CheckpointConfig(enabled=False)),
        state=LoopState(),
        clusters=None,  # type: ignore[arg-type]
    )
    seen: list[int] = []

    def step(number: int) -> dict[str, float]:
        seen.extend(run.batches.next_batch())
        return {"loss": float(number)}

    result = run_loop(run, step, lambda: {"loss": float(len(seen))})
    logger.close()
    assert result.final_step == 6  # 3 batches per epoch, 2 epochs
    assert sorted(seen) == sorted(list(range(6)) * 2)
    assert result.validation_history == [(0, 0.0), (4, 8.0), (6, 12.0)]
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["prefix"] == "train"] == [1, 2, 3, 4, 5, 6]
