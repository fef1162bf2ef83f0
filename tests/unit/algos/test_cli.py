"""The `rl` command: bad overrides and bad data stop the run before any training, with exit
status 2 and one message naming the culprit; help, recipe lookup and dry runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_algos import cli
from rl_core.config import load_validated_config

REPO = Path(__file__).resolve().parents[3]
APPS_CONFIGS = REPO / "apps" / "configs"


def rl_command() -> list[str]:
    script = Path(sys.executable).with_name("rl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rl_algos.cli"]


def run_rl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RL_CACHE_DIR": str(cwd / "cache"), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(
        [*rl_command(), "grpo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def assert_stopped_before_training(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert message.startswith("rl grpo: error:"), message
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in message, message
    # Nothing started: no Ray cluster, no model building, no step.
    assert "Ray" not in result.stdout + result.stderr
    assert "base model" not in result.stdout and "step " not in result.stdout


def test_unknown_override_key_names_the_key_and_the_fix(tmp_path: Path) -> None:
    result = run_rl("grpo.num_prompts_per_stepp=8", cwd=tmp_path)
    assert_stopped_before_training(
        result, "unknown config key 'grpo.num_prompts_per_stepp'", "did you mean 'grpo.num_prompts_per_step'"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_wrongly_typed_override_names_key_type_and_value(tmp_path: Path) -> None:
    result = run_rl("grpo.max_num_steps=many", cwd=tmp_path)
    assert_stopped_before_training(
        result, "grpo.max_num_steps: expected int, got 'many'", "override 'grpo.max_num_steps=many'"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_dataset_column_names_file_record_and_column(tmp_path: Path) -> None:
    data = tmp_path / "questions.jsonl"
    data.write_text(
        json.dumps({"prompt": "What is 1 + 1?", "answer": "2"})
        + "\n"
        + json.dumps({"question": "What is 2 + 2?", "solution": "4"})
        + "\n"
    )
    result = run_rl(f"data.train={{path: {data}}}", cwd=tmp_path)
    assert_stopped_before_training(result, f"{data}:2: record 1 has no column 'prompt'", "question, solution")


def test_unreadable_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "broken.jsonl"
    lines = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(3)]
    lines.insert(2, '{"prompt": "What is 9 + 1?", "answer": ')
    data.write_text("\n".join(lines) + "\n")
    result = run_rl(f"data.validation={{path: {data}}}", cwd=tmp_path)
    assert_stopped_before_training(result, f"{data}:3: invalid JSON")


def test_help_lists_subcommands_and_override_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as top:
        cli.run(["--help"])
    assert top.value.code == 0
    assert "grpo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as sub:
        cli.run(["grpo", "--help"])
    assert sub.value.code == 0
    text = capsys.readouterr().out
    assert "--config" in text and "++key.path=value" in text and "grpo_tiny_cpu.yaml" in text


def test_dry_run_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["grpo", "--dry-run", "grpo.max_num_steps=7", "cluster.workers_per_node=1"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["grpo"]["max_num_steps"] == 7
    assert resolved["policy"]["model_name"] == "base_model"


def test_config_errors_exit_2_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.run(["grpo", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    # A recipe that breaks a cross-field rule: the global batch must divide the step's samples.
    assert cli.run(["grpo", "--dry-run", "policy.train_global_batch_size=100"]) == 2
    assert "policy.train_global_batch_size (100) must divide" in capsys.readouterr().err


def test_packaged_recipe_by_name() -> None:
    assert cli.resolve_recipe(cli.SUBCOMMANDS["grpo"], "grpo_tiny_cpu") == cli.packaged_recipe(
        "grpo_tiny_cpu.yaml"
    )
    assert cli.resolve_recipe(cli.SUBCOMMANDS["grpo"], None).name == "grpo_tiny_cpu.yaml"


def test_subcommand_registry_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        cli.register_subcommand(cli.SUBCOMMANDS["grpo"])


@pytest.mark.parametrize("recipe", sorted(APPS_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(recipe: Path) -> None:
    """Recipes are named `<subcommand>_<what>.yaml` and validate against that subcommand's schema."""
    subcommand = cli.SUBCOMMANDS.get(recipe.name.split("_", 1)[0])
    assert subcommand is not None, f"{recipe.name} does not start with a subcommand ({sorted(cli.SUBCOMMANDS)})"
    cfg = load_validated_config(recipe, cli.import_target(subcommand.schema))
    assert cfg.to_dict()


def test_policy_generation_backend_selects_the_rollout_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """NeMo RL recipes name the engine at `policy.generation.backend`; it selects ours too, and
    generation workers never receive it (they take the sampling settings alone)."""
    assert cli.run(["grpo", "--dry-run", "policy.generation.backend=vllm"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["generation"]["backend"] == "vllm"
    grpo = cli.import_target(cli.SUBCOMMANDS["grpo"].schema)
    cfg = load_validated_config(cli.packaged_recipe("grpo_tiny_cpu.yaml"), grpo, ["policy.generation.backend=vllm"])
    assert "backend" not in cfg.policy.generation.sampling().model_dump()
    assert cfg.policy.generation.sampling().temperature == cfg.policy.generation.temperature
    # Naming two different engines, or an unknown one, is an error naming the keys.
    assert cli.run(["grpo", "--dry-run", "policy.generation.backend=vllm", "generation.backend=hf"]) == 2
    err = capsys.readouterr().err
    assert "policy.generation.backend is 'vllm' but generation.backend is 'hf'" in err
    assert cli.run(["grpo", "--dry-run", "policy.generation.backend=sglang"]) == 2
    assert "generation.backend: expected one of 'hf', 'vllm', got 'sglang'" in capsys.readouterr().err
