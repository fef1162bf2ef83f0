"""Config loading: `defaults:` inheritance, overrides, interpolation, validation errors."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import Field, ValidationError

from rl_core.config import (
    ConfigError,
    RLConfig,
    apply_overrides,
    config_to_dict,
    load_config,
    load_validated_config,
    save_config,
    validate_config,
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


class LoraConfig(RLConfig):
    rank: int = 8
    alpha: float = 16.0


class PolicyConfig(RLConfig):
    model_name: str
    max_total_sequence_length: int = 512
    lora: LoraConfig | None = None


class GRPOConfig(RLConfig):
    num_prompts_per_step: int
    num_generations_per_prompt: int = 4
    max_seq_len: int = 256
    normalize_rewards: bool = True
    loss_type: Literal["token", "sequence"] = "token"
    seed: int | str = 0


class RecipeConfig(RLConfig):
    grpo: GRPOConfig
    policy: PolicyConfig
    env: dict[str, Any] = Field(default_factory=dict)


RECIPE = """
grpo:
  num_prompts_per_step: 8
  max_seq_len: 1024
policy:
  model_name: tiny-llama
  max_total_sequence_length: ${grpo.max_seq_len}
"""


# --------------------------------------------------------------------------- defaults


def test_defaults_inherit_over_two_levels_relative_to_including_file(tmp_path: Path) -> None:
    write(
        tmp_path / "common" / "base.yaml",
        """
        grpo: {num_prompts_per_step: 4, max_seq_len: 128, stop: ["</s>"], clip: {low: 0.2, high: 0.2}}
        policy: {model_name: base-model, dtype: float32}
        logger: {log_dir: logs}
        """,
    )
    # Relative to common/mid.yaml, not to the child or the working directory.
    write(
        tmp_path / "common" / "mid.yaml",
        """
        defaults: base.yaml
        grpo: {max_seq_len: 256, clip: {high: 0.28}}
        policy: {dtype: bfloat16}
        """,
    )
    write(tmp_path / "common" / "extra.yaml", "policy: {dtype: float16, tp: 2}\n")
    child = write(
        tmp_path / "recipes" / "child.yaml",
        """
        defaults: [../common/mid.yaml, ../common/extra]
        grpo:
          num_prompts_per_step: 16
          stop: ["<|im_end|>", "</answer>"]
        logger: null
        """,
    )
    assert load_config(child) == {
        "grpo": {
            "num_prompts_per_step": 16,  # child beats both ancestors
            "max_seq_len": 256,  # mid beats base
            "stop": ["<|im_end|>", "</answer>"],  # lists are replaced, not merged
            "clip": {"low": 0.2, "high": 0.28},  # nested mappings merge key by key
        },
        "policy": {"model_name": "base-model", "dtype": "float16", "tp": 2},  # later default wins
        "logger": None,  # an explicit null overrides an inherited section
    }


def test_defaults_cycle_names_the_chain(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", "defaults: b.yaml\nx: 1\n")
    write(tmp_path / "b.yaml", "defaults: [c.yaml]\n")
    write(tmp_path / "c.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(a)
    assert str(info.value) == (
        f"circular 'defaults' inclusion: {tmp_path}/a.yaml -> {tmp_path}/b.yaml -> "
        f"{tmp_path}/c.yaml -> {tmp_path}/a.yaml"
    )


def test_missing_default_names_the_file_and_who_included_it(tmp_path: Path) -> None:
    child = write(tmp_path / "child.yaml", "x: 1\ndefaults:\n  - base.yaml\n  - nope.yaml\n")
    write(tmp_path / "base.yaml", "y: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(child)
    assert str(info.value) == (
        f"config file not found: {tmp_path}/nope.yaml (listed in 'defaults' at {child}:2)"
    )


def test_missing_top_level_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {tmp_path}/absent.yaml")):
        load_config(tmp_path / "absent.yaml")


def test_malformed_yaml_reports_path_line_and_column(tmp_path: Path) -> None:
    bad = write(
        tmp_path / "bad.yaml",
        """
        grpo:
          num_prompts_per_step: 8
           max_seq_len: 256
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    first_line = str(info.value).splitlines()[0]
    assert first_line == f"{bad}:3:15: malformed YAML: mapping values are not allowed here"


def test_malformed_yaml_in_an_included_file_names_both_files(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "a: [1, 2\nb: 3\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(child)
    message = str(info.value)
    assert message.startswith(f"{tmp_path}/base.yaml:2:2: malformed YAML: expected ',' or ']', but got ':'")
    assert message.endswith(f"(listed in 'defaults' at {child}:1)")


def test_duplicate_key_is_an_error_with_both_lines(tmp_path: Path) -> None:
    bad = write(tmp_path / "dup.yaml", "grpo:\n  lr: 1\n  seed: 2\n  lr: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value) == f"{bad}:4: duplicate key 'grpo.lr' (first defined on line 2)"


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    bad = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"{bad}:1: a config file must be a mapping")):
        load_config(bad)


def test_exponent_floats_without_a_dot_are_floats(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path / "r.yaml", "lr: 1e-5\nwd: 1.0e-2\nsteps: 100\nname: e5\n"))
    assert cfg == {"lr": 1e-5, "wd": 0.01, "steps": 100, "name": "e5"}
    assert isinstance(cfg["lr"], float) and isinstance(cfg["steps"], int)


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("grpo.max_seq_len=2048", 2048),
        ("grpo.max_seq_len=1.5", 1.5),
        ("grpo.max_seq_len=3e-4", 3e-4),
        ("grpo.max_seq_len=true", True),
        ("grpo.max_seq_len=null", None),
        ("grpo.max_seq_len=[1,2]", [1, 2]),
        ("grpo.max_seq_len={a: 1}", {"a": 1}),
        ("grpo.max_seq_len=hello world", "hello world"),
        ("grpo.max_seq_len=", ""),
        ("grpo.max_seq_len=a=b", "a=b"),
    ],
)
def test_override_values_are_parsed_as_yaml(text: str, expected: Any) -> None:
    cfg = apply_overrides({"grpo": {"max_seq_len": 256}}, [text])
    assert cfg == {"grpo": {"max_seq_len": expected}}


def test_overrides_apply_in_order_and_do_not_mutate_the_input() -> None:
    original = {"grpo": {"num_prompts_per_step": 8, "stop": ["a"]}, "policy": {"model_name": "m"}}
    result = apply_overrides(
        original,
        [
            "grpo.num_prompts_per_step=16",
            "++policy.lora.rank=8",  # ++ creates missing sections
            "++grpo.num_prompts_per_step=32",  # ++ also replaces
            "+grpo.seed=3",
            "~policy.model_name",
            "grpo.stop.0=b",
        ],
    )
    assert result == {
        "grpo": {"num_prompts_per_step": 32, "stop": ["b"], "seed": 3},
        "policy": {"lora": {"rank": 8}},
    }
    assert original == {"grpo": {"num_prompts_per_step": 8, "stop": ["a"]}, "policy": {"model_name": "m"}}


def test_unknown_override_key_suggests_the_closest_key(tmp_path: Path) -> None:
    recipe = write(tmp_path / "grpo.yaml", RECIPE)
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["grpo.num_prompts_per_stp=3"])
    assert str(info.value) == (
        "unknown config key 'grpo.num_prompts_per_stp' (did you mean 'grpo.num_prompts_per_step'?) "
        "in override 'grpo.num_prompts_per_stp=3'"
    )
    # A typo in the section name suggests the full key with the section fixed.
    with pytest.raises(
        ConfigError, match=re.escape("'grpoo.max_seq_len' (did you mean 'grpo.max_seq_len'?)")
    ):
        load_config(recipe, ["grpoo.max_seq_len=3"])
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["zzz=1"])
    assert str(info.value) == "unknown config key 'zzz' in override 'zzz=1'; to add a new key write '++zzz=1'"


def test_schema_declared_keys_may_be_overridden_even_if_absent_from_yaml(tmp_path: Path) -> None:
    recipe = write(tmp_path / "grpo.yaml", RECIPE)
    cfg = load_config(
        recipe,
        ["grpo.num_generations_per_prompt=16", "policy.lora.rank=4", "env.math.workers=2"],
        schema=RecipeConfig,
    )
    assert cfg["grpo"]["num_generations_per_prompt"] == 16
    assert cfg["policy"]["lora"] == {"rank": 4}
    assert cfg["env"] == {"math": {"workers": 2}}  # env is a free-form mapping in the schema
    # Without the schema the same key is unknown; with it, a typo suggests the schema's field.
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'grpo.num_generations_per_prompt'")):
        load_config(recipe, ["grpo.num_generations_per_prompt=16"])
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["grpo.num_generation_per_prompt=16"], schema=RecipeConfig)
    assert "(did you mean 'grpo.num_generations_per_prompt'?)" in str(info.value)
    with pytest.raises(ConfigError, match=re.escape("(did you mean 'policy.lora.rank'?)")):
        load_config(recipe, ["policy.lora.rnk=4"], schema=RecipeConfig)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("grpo.max_seq_len", "malformed override 'grpo.max_seq_len': missing '=value'"),
        ("=5", "malformed override '=5': expected 'key.path=value'"),
        ("grpo..max_seq_len=5", "malformed override 'grpo..max_seq_len=5'"),
        ("grpo.max seq=5", "malformed override 'grpo.max seq=5'"),
        ("~grpo.max_seq_len=5", "malformed override '~grpo.max_seq_len=5': a deletion takes no value"),
        (
            "grpo.max_seq_len=[1, 2",
            "malformed override 'grpo.max_seq_len=[1, 2': the value is not valid YAML",
        ),
        ("+++grpo.x=1", "malformed override '+++grpo.x=1'"),
    ],
)
def test_malformed_override_syntax_is_quoted(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"grpo": {"max_seq_len": 1}}, [text])
    assert str(info.value).startswith(message)


def test_override_conflicts_are_explained() -> None:
    cfg = {"grpo": {"max_seq_len": 256}, "policy": {"model_name": "m"}, "stop": ["a"]}
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["+grpo.max_seq_len=3"])
    assert str(info.value) == (
        "cannot apply override '+grpo.max_seq_len=3': key 'grpo.max_seq_len' already exists (value 256); "
        "use 'grpo.max_seq_len=3' to replace it or '++grpo.max_seq_len=3' to add-or-replace"
    )
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["policy.model_name.revision=1"])
    assert str(info.value) == (
        "cannot apply override 'policy.model_name.revision=1': 'policy.model_name' holds 'm' (str), "
        "not a mapping"
    )
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["~policy.model_nam"])
    assert str(info.value) == (
        "unknown config key 'policy.model_nam' (did you mean 'policy.model_name'?) in override '~policy.model_nam'"
    )
    with pytest.raises(ConfigError, match="index 3 is out of range for 'stop' \\(length 1\\)"):
        apply_overrides(cfg, ["stop.3=b"])
    with pytest.raises(TypeError, match="sequence of strings"):
        apply_overrides(cfg, "grpo.max_seq_len=3")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- interpolation


def test_interpolation_keeps_type_substitutes_text_and_follows_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RL_TEST_RUN", "run-7")
    monkeypatch.delenv("RL_TEST_UNSET", raising=False)
    recipe = write(
        tmp_path / "r.yaml",
        """
        grpo: {max_seq_len: 1024, clip: {low: 0.2}}
        policy:
          max_len: ${grpo.max_seq_len}
          twice: ${policy.max_len}
          clip: ${grpo.clip}
          first_stop: ${stops.1}
        stops: [a, b]
        name: "len${grpo.max_seq_len}-${grpo.clip.low}-${flag}-${nothing}"
        flag: true
        nothing: null
        run: ${env:RL_TEST_RUN}
        dir: /ckpt/${env:RL_TEST_RUN}/x
        fallback: ${env:RL_TEST_UNSET,local}
        empty_fallback: ${env:RL_TEST_UNSET,}
        literal: \\${not.a.reference}
        """,
    )
    cfg = load_config(recipe, ["grpo.max_seq_len=2048"])
    assert cfg["policy"] == {"max_len": 2048, "twice": 2048, "clip": {"low": 0.2}, "first_stop": "b"}
    assert type(cfg["policy"]["max_len"]) is int
    assert cfg["name"] == "len2048-0.2-true-null"
    assert cfg["run"] == "run-7"
    assert cfg["dir"] == "/ckpt/run-7/x"
    assert cfg["fallback"] == "local"
    assert cfg["empty_fallback"] == ""
    assert cfg["literal"] == "${not.a.reference}"
    # A whole-value mapping reference is a copy, not an alias.
    cfg["policy"]["clip"]["low"] = 0.5
    assert cfg["grpo"]["clip"]["low"] == 0.2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "a: ${grpo.max_seq_lenn}\ngrpo: {max_seq_len: 1}\n",
            "config key 'a' refers to '${grpo.max_seq_lenn}', but 'grpo.max_seq_lenn' does not exist "
            "(did you mean 'grpo.max_seq_len'?)",
        ),
        (
            "x: {y: 'pre-${missing.key}'}\n",
            "config key 'x.y' refers to '${missing.key}', but 'missing' does not exist",
        ),
        ("a: ${b}\nb: ${c}\nc: ${a}\n", "interpolation cycle: a -> b -> c -> a"),
        ("a: ${a}\n", "interpolation cycle: a -> a"),
        (
            "a: ${env:RL_TEST_UNSET}\n",
            "config key 'a' refers to environment variable 'RL_TEST_UNSET', which is not set "
            "(set it, or give a default: '${env:RL_TEST_UNSET,<default>}')",
        ),
        (
            "a: 'x-${b}'\nb: [1]\n",
            "config key 'a': '${b}' is a list and cannot be embedded in the string 'x-${b}'",
        ),
        ("a: 'x-${b'\nb: 1\n", "config key 'a': unterminated '${' in 'x-${b'"),
    ],
)
def test_interpolation_errors_name_the_key_and_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, message: str
) -> None:
    monkeypatch.delenv("RL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path / "r.yaml", body))
    assert str(info.value).startswith(message)


# --------------------------------------------------------------------------- validation


def test_unknown_key_in_yaml_file_is_reported_with_suggestion_and_line(tmp_path: Path) -> None:
    recipe = write(
        tmp_path / "grpo.yaml",
        """
        grpo:
          num_prompts_per_step: 8
          num_generatons_per_prompt: 4
        policy:
          model_name: tiny
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_validated_config(recipe, RecipeConfig)
    assert str(info.value) == (
        f"invalid config in {recipe} (1 problem):\n"
        "  - unknown key 'grpo.num_generatons_per_prompt' (did you mean "
        f"'grpo.num_generations_per_prompt'?) [{recipe}:3]"
    )


def test_wrong_type_names_key_value_and_expected_type(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", RECIPE)
    child = write(
        tmp_path / "child.yaml",
        """
        defaults: base.yaml
        grpo:
          num_prompts_per_step: eight
          loss_type: tokens
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_validated_config(child, RecipeConfig, ["policy.max_total_sequence_length=1.5", "grpo.seed=[1]"])
    assert str(info.value) == "\n".join(
        [
            f"invalid config in {child} (4 problems):",
            f"  - grpo.num_prompts_per_step: expected int, got 'eight' (str) [{child}:3]",
            f"  - grpo.loss_type: expected one of 'token', 'sequence', got 'tokens' (str) [{child}:4]",
            "  - grpo.seed: expected int | str, got [1] (list) [override 'grpo.seed=[1]']",
            "  - policy.max_total_sequence_length: expected int, got 1.5 (float) "
            "[override 'policy.max_total_sequence_length=1.5']",
        ]
    )
    assert base.exists()


def test_validate_config_reports_missing_keys_and_nested_problems() -> None:
    cfg = {"grpo": {"max_seq_len": 10}, "policy": {"model_name": 3, "lora": {"rank": "r", "alpah": 1}}}
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, RecipeConfig, source="cli")
    assert str(info.value) == "\n".join(
        [
            "invalid config in cli (4 problems):",
            "  - missing required key 'grpo.num_prompts_per_step' (int)",
            "  - policy.model_name: expected str, got 3 (int)",
            "  - policy.lora.rank: expected int, got 'r' (str)",
            "  - unknown key 'policy.lora.alpah' (did you mean 'policy.lora.alpha'?)",
        ]
    )
    with pytest.raises(ConfigError) as info:
        validate_config({"grpo": 5, "policy": {"model_name": "m"}}, RecipeConfig)
    assert str(info.value) == (
        "invalid config (1 problem):\n  - grpo: expected a mapping (GRPOConfig), got 5 (int)"
    )


def test_valid_config_round_trips_through_yaml(tmp_path: Path) -> None:
    recipe = write(tmp_path / "grpo.yaml", RECIPE)
    model = load_validated_config(recipe, RecipeConfig, ["grpo.num_generations_per_prompt=2"])
    assert model.grpo.num_prompts_per_step == 8
    assert model.grpo.num_generations_per_prompt == 2
    assert model.policy.max_total_sequence_length == 1024  # interpolated, then validated as int
    assert RecipeConfig.from_yaml(recipe, ["grpo.num_generations_per_prompt=2"]) == model

    saved = save_config(model, tmp_path / "out" / "config.yaml")
    assert yaml.safe_load(saved.read_text()) == config_to_dict(model)
    assert validate_config(load_config(saved), RecipeConfig) == model
    # Dict configs are saved resolved.
    save_config({"a": 3, "b": "${a}", "c": "x${a}"}, tmp_path / "plain.yaml")
    assert yaml.safe_load((tmp_path / "plain.yaml").read_text()) == {"a": 3, "b": 3, "c": "x3"}


def test_config_to_dict_gives_plain_values() -> None:
    class Paths(RLConfig):
        root: Path = Path("/data")
        sizes: tuple[int, ...] = (1, 2)
        max_grad_norm: float = math.inf

    assert config_to_dict(Paths()) == {"root": "/data", "sizes": [1, 2], "max_grad_norm": math.inf}


def test_rl_config_forbids_extra_keys_and_validates_assignment() -> None:
    lora = LoraConfig(rank=4)
    with pytest.raises(ValidationError):
        lora.rank = "four"  # type: ignore[assignment]
    with pytest.raises(ValidationError):
        LoraConfig(rnak=4)  # type: ignore[call-arg]
    assert PolicyConfig(model_name="m").model_name == "m"  # no 'model_' namespace warning/error
