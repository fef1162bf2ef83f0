"""Checkpoint manager: atomic writes, interrupted saves, keep-top-k, discovery, compatibility."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rl_core.checkpoint import CheckpointConfig, CheckpointIncompatibleError, CheckpointManager

CONFIG = {"policy": {"model_name": "tiny-llama", "dtype": "float32"}, "grpo": {"num_prompts_per_step": 8}}


def manager(tmp_path: Path, **overrides: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt"), **overrides))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> bytes)."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def save_with_weights(mgr: CheckpointManager, step: int, info: dict[str, Any], seed: int = 0) -> Path:
    with mgr.save(step, info, CONFIG) as tmp:
        (tmp / "policy").mkdir()
        torch.save(
            {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))},
            tmp / "policy" / "weights.pt",
        )
        torch.save({"epoch": 0, "position": step * 8}, tmp / "dataloader.pt")
    return mgr.checkpoint_dir / f"step_{step}"


def surviving_steps(mgr: CheckpointManager) -> list[int]:
    return [step for step, _ in mgr.list_checkpoints()]


def test_save_writes_layout_and_reads_back(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    path = save_with_weights(
        mgr, 3, {"step": 3, "model_name": "tiny-llama", "val/accuracy": torch.tensor(0.5)}
    )
    assert path == tmp_path / "ckpt" / "step_3"
    assert sorted(snapshot(path)) == [
        "config.yaml",
        "dataloader.pt",
        "policy/weights.pt",
        "training_info.json",
    ]
    assert list(mgr.checkpoint_dir.iterdir()) == [path]  # no tmp dir left behind
    assert mgr.load_training_info(path) == {"step": 3, "model_name": "tiny-llama", "val/accuracy": 0.5}
    assert mgr.load_config(path) == CONFIG
    assert yaml.safe_load((path / "config.yaml").read_text()) == CONFIG
    assert torch.load(path / "dataloader.pt") == {"epoch": 0, "position": 24}
    assert mgr.get_latest_checkpoint_path() == path


def test_two_phase_api(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    tmp = mgr.init_tmp_checkpoint(5, {"step": 5}, CONFIG)
    assert tmp == tmp_path / "ckpt" / "tmp_step_5"
    assert mgr.get_latest_checkpoint_path() is None  # an unfinished checkpoint is never "latest"
    (tmp / "optimizer.pt").write_bytes(b"state")
    final = mgr.finalize_checkpoint(tmp)
    assert final == tmp_path / "ckpt" / "step_5"
    assert not tmp.exists()
    assert (final / "optimizer.pt").read_bytes() == b"state"
    with pytest.raises(ValueError, match="is not a tmp_step_N directory"):
        mgr.finalize_checkpoint(final)


def test_interrupted_save_leaves_previous_checkpoint_untouched(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    previous = save_with_weights(mgr, 1, {"step": 1}, seed=1)
    before = snapshot(previous)

    with pytest.raises(RuntimeError, match="disk full"), mgr.save(2, {"step": 2}, CONFIG) as tmp:
        (tmp / "policy").mkdir()
        (tmp / "policy" / "weights.pt").write_bytes(b"half-written")
        raise RuntimeError("disk full")

    assert snapshot(previous) == before
    assert sorted(p.name for p in mgr.checkpoint_dir.iterdir()) == ["step_1"]
    assert mgr.get_latest_checkpoint_path() == previous

    # Failing while re-saving the *same* step must not damage the existing step_1 either.
    with pytest.raises(KeyboardInterrupt), mgr.save(1, {"step": 1, "retry": True}, CONFIG) as tmp:
        (tmp / "dataloader.pt").write_bytes(b"partial")
        raise KeyboardInterrupt
    assert snapshot(previous) == before
    assert sorted(p.name for p in mgr.checkpoint_dir.iterdir()) == ["step_1"]


def test_saving_an_existing_step_replaces_it_completely(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    path = save_with_weights(mgr, 4, {"step": 4, "attempt": 1}, seed=1)
    (path / "stale_extra_file").write_text("from attempt 1")
    save_with_weights(mgr, 4, {"step": 4, "attempt": 2}, seed=2)
    assert mgr.load_training_info(path)["attempt"] == 2
    assert not (path / "stale_extra_file").exists()
    expected = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(torch.load(path / "policy" / "weights.pt")["w"], expected)
    assert sorted(p.name for p in mgr.checkpoint_dir.iterdir()) == ["step_4"]


METRICS = [0.5, 0.9, 0.3, 0.8, 0.95, 0.1]


@pytest.mark.parametrize(
    ("higher_is_better", "survivors_after_each_save", "best"),
    [
        # k=2 best plus the newest; worked out by hand from METRICS.
        (True, [[1], [1, 2], [1, 2, 3], [2, 4], [2, 5], [2, 5, 6]], 5),
        (False, [[1], [1, 2], [1, 3], [1, 3, 4], [1, 3, 5], [3, 6]], 6),
    ],
)
def test_keep_top_k_by_metric(
    tmp_path: Path, higher_is_better: bool, survivors_after_each_save: list[list[int]], best: int
) -> None:
    mgr = manager(tmp_path, keep_top_k=2, metric_name="val/accuracy", higher_is_better=higher_is_better)
    for step, (value, survivors) in enumerate(zip(METRICS, survivors_after_each_save), start=1):
        mgr.init_tmp_checkpoint(step, {"step": step, "val/accuracy": value}, CONFIG)
        mgr.finalize_checkpoint(mgr.checkpoint_dir / f"tmp_step_{step}")
        assert surviving_steps(mgr) == survivors, f"after saving step {step}"
    assert mgr.get_best_checkpoint_path() == mgr.checkpoint_dir / f"step_{best}"
    assert mgr.get_latest_checkpoint_path() == mgr.checkpoint_dir / "step_6"


def test_keep_top_k_matches_a_brute_force_reference(tmp_path: Path) -> None:
    values = [0.3, 0.7, 0.7, 0.1, 0.9, 0.2, 0.5, 0.7, 0.05, 0.6, 0.65, 0.4]
    k = 3
    mgr = manager(tmp_path, keep_top_k=k, metric_name="reward", higher_is_better=True)
    alive: list[int] = []
    for step, value in enumerate(values, start=1):
        with mgr.save(step, {"reward": value}, CONFIG):
            pass
        alive.append(step)
        # Reference: the k largest (value, step) pairs - ties go to the newer step - plus the newest.
        best = sorted(alive, key=lambda s: (values[s - 1], s), reverse=True)[:k]
        alive = sorted(set(best) | {step})
        assert surviving_steps(mgr) == alive


def test_keep_top_k_without_metric_keeps_the_newest(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_top_k=2)
    for step in (10, 20, 30, 40):
        with mgr.save(step, {"step": step}, CONFIG):
            pass
    assert surviving_steps(mgr) == [30, 40]
    assert mgr.get_best_checkpoint_path() == mgr.checkpoint_dir / "step_40"


def test_checkpoints_missing_the_metric_rank_last_with_a_warning(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_top_k=1, metric_name="val/accuracy")
    with mgr.save(1, {"val": {"accuracy": 0.7}}, CONFIG):  # nested form is found too
        pass
    missing = re.escape("step_2 has no finite 'val/accuracy' in training_info.json (found None)")
    with pytest.warns(UserWarning, match=missing), mgr.save(2, {"step": 2}, CONFIG):
        pass
    assert surviving_steps(mgr) == [1, 2]  # 1 is the best, 2 the newest
    with pytest.warns(UserWarning, match="step_3"), mgr.save(3, {"val/accuracy": float("nan")}, CONFIG):
        pass
    assert surviving_steps(mgr) == [1, 3]
    with mgr.save(4, {"val/accuracy": 0.8}, CONFIG):
        pass
    assert surviving_steps(mgr) == [4]


def test_latest_discovery_ignores_unfinished_directories(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    assert mgr.get_latest_checkpoint_path() is None
    for step in (2, 10, 9):
        with mgr.save(step, {"step": step}, CONFIG):
            pass
    (mgr.checkpoint_dir / "tmp_step_50").mkdir()  # being written (or crashed) - not complete
    (mgr.checkpoint_dir / "tmp_step_50" / "training_info.json").write_text("{}")
    (mgr.checkpoint_dir / "step_40").mkdir()  # no training_info.json: not a checkpoint
    (mgr.checkpoint_dir / "step_x").mkdir()
    (mgr.checkpoint_dir / "notes.txt").write_text("hi")
    assert mgr.get_latest_checkpoint_path() == mgr.checkpoint_dir / "step_10"  # numeric, not lexical
    assert surviving_steps(mgr) == [2, 9, 10]


def test_stale_tmp_dirs_are_removed_at_startup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = manager(tmp_path)
    kept = save_with_weights(mgr, 5, {"step": 5})
    before = snapshot(kept)
    crashed = mgr.init_tmp_checkpoint(6, {"step": 6}, CONFIG)
    (crashed / "weights.pt").write_bytes(b"partial")
    # A run killed between moving step_3 aside and renaming its replacement into place:
    (mgr.checkpoint_dir / "old_step_3").mkdir()
    (mgr.checkpoint_dir / "old_step_3" / "training_info.json").write_text('{"step": 3}')
    (mgr.checkpoint_dir / "tmp_step_3").mkdir()
    # ... and one killed after the replacement landed but before the old copy was deleted:
    (mgr.checkpoint_dir / "old_step_5").mkdir()

    with caplog.at_level(logging.WARNING, logger="rl_core.checkpoint"):
        restarted = manager(tmp_path)
    assert sorted(p.name for p in restarted.checkpoint_dir.iterdir()) == ["step_3", "step_5"]
    assert restarted.load_training_info(restarted.checkpoint_dir / "step_3") == {"step": 3}
    assert snapshot(kept) == before
    messages = [r.getMessage() for r in caplog.records]
    assert f"removing incomplete checkpoint {crashed} left by an interrupted run" in messages
    assert any("restoring" in m and "step_3" in m for m in messages)


def test_check_compatible_refuses_a_different_model(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    path = save_with_weights(mgr, 1, {"step": 1, "model_name": "tiny-llama", "vocab_size": 512})
    mgr.check_compatible(path, {"model_name": "tiny-llama", "vocab_size": 512, "policy.dtype": "float32"})
    with pytest.raises(CheckpointIncompatibleError) as info:
        mgr.check_compatible(path, {"model_name": "tiny-qwen"})
    assert str(info.value) == (
        f"checkpoint {path} is incompatible with this run: 'model_name' was saved as 'tiny-llama' "
        "but this run expects 'tiny-qwen'"
    )
    with pytest.raises(CheckpointIncompatibleError) as info:
        mgr.check_compatible(
            path, {"policy.model_name": "tiny-llama", "policy.dtype": "bfloat16", "tokenizer": "t"}
        )
    assert str(info.value) == (
        f"checkpoint {path} is incompatible with this run: 'policy.dtype' was saved as 'float32' but this "
        "run expects 'bfloat16'; 'tokenizer' is not recorded in it (this run expects 't')"
    )


def test_should_save_and_disabled_checkpointing(tmp_path: Path) -> None:
    mgr = manager(tmp_path, save_period=3)
    assert [s for s in range(1, 11) if mgr.should_save(s)] == [3, 6, 9]
    assert mgr.should_save(10, is_last_step=True)
    off = CheckpointManager(CheckpointConfig(enabled=False, checkpoint_dir=str(tmp_path / "off")))
    assert not off.should_save(3)
    assert not (tmp_path / "off").exists()
    with pytest.raises(RuntimeError, match="checkpointing is disabled"):
        off.init_tmp_checkpoint(1, {}, CONFIG)


def test_unreadable_training_info_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "step_1"
    broken.mkdir()
    (broken / "training_info.json").write_text('{"step": 1,\n "x": }')
    with pytest.raises(ValueError, match=re.escape(f"{broken}/training_info.json:2:7: malformed JSON")):
        CheckpointManager.load_training_info(broken)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no training_info.json in checkpoint {tmp_path}")):
        CheckpointManager.load_training_info(tmp_path)
    with pytest.raises(ValueError, match="checkpoint step must be a non-negative int, got -1"):
        manager(tmp_path).init_tmp_checkpoint(-1, {}, CONFIG)
