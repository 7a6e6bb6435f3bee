"""The config tree: every field reachable from its flag and from a config file, with help; every check's error
naming the flag the user typed (or the file's key); flags override the file."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from alchemist.config import Config, OnlineConfig, RecordConfig
from alchemist.config.fields import field_type, flag_help, flag_of
from alchemist.config.parse import parse_config
from alchemist.config.root import leaves
from alchemist.config.training import FORMER_KEYS, QueueConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("host_budget_bytes", -1, "host_budget_bytes"),
        ("disk_budget_bytes", 1.5, "disk_budget_bytes"),
        ("store_budget_bytes", True, "store_budget_bytes"),
        ("disk_dir", " ", "disk_dir"),
        ("evict_priority", "fifo", "evict_priority"),
    ],
)
def test_record_config_rejects_bad_tier_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        RecordConfig(**{field: value})


def test_record_flags_map_to_the_tiers(tmp_path):
    defaults = parse_config([]).record
    assert (defaults.store_budget_bytes, defaults.host_budget_bytes, defaults.disk_budget_bytes) == (
        2 << 30,
        4 << 30,
        16 << 30,
    )
    assert defaults.disk_dir is None
    args = ["--record-budget-mb", "1", "--record-host-budget-mb", "0", "--record-disk-budget-mb", "3"]
    config = parse_config([*args, "--record-dir", str(tmp_path)]).record
    assert (config.store_budget_bytes, config.host_budget_bytes, config.disk_budget_bytes) == (1 << 20, 0, 3 << 20)
    assert config.disk_dir == str(tmp_path)


def _other_value(cls: type, field: dataclasses.Field):
    """A valid value of the field other than its default."""
    kind, default = field_type(cls, field.name), field.default
    special = {"host": "localhost", "port": 8001, "max_num_seqs": 8, "betas": (0.8, 0.99), "slo_tpot_s": 0.04,
               "lora_modules": ("team-a=/adapters/team-a",),
               "feedback_db": "postgresql://db.example/alchemist"}  # which --replicas above 1 needs (Config.check)
    if field.name in special:
        return special[field.name]
    if kind is bool:
        return not default
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != default)
    if kind is int or kind == int | None:
        return (default or 64) * 2 if default != 0 else 3
    if kind is float:
        return default / 2 if default else 0.5
    if typing.get_args(kind) == (bool, type(None)):
        return True
    return f"other-{default}" if default else "chosen"


def _typed(cls: type, name: str, value) -> list[str]:
    """``value`` as a user types the field's flag."""
    flag, unit = flag_of(cls, name)
    if field_type(cls, name) is bool:
        return [flag if value else f"--no-{flag[2:]}"]
    if isinstance(value, tuple):
        return [flag, *map(str, value)]
    return [flag, unit.str_from_instance(value)[0] if unit else str(value)]


def _get(config: Config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _nested(path: str, value) -> dict:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def _merge(into: dict, nested: dict) -> None:
    for key, value in nested.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        else:
            into[key] = value


def test_every_field_has_a_flag_with_help_and_a_file_key(tmp_path, capsys):
    """Walks the tree: each field's flag is in --help with its help text, sets the field, and so does its key in a
    YAML file (and in TOML for one); none of the values is the default, so each assignment is seen. All the flags go
    in one command line and all the keys in one file (a parse builds tyro's parser anew: 0.1 s each)."""
    with pytest.raises(SystemExit) as done:
        parse_config(["--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    sections = ("engine options", "record options", "online options", "online.trainer options", "server options",
                "scale options")  # fmt: skip
    for section in sections:
        assert section in help_text
    values, argv, data = {}, [], {}
    for path, cls, field in leaves():
        flag, _ = flag_of(cls, field.name)
        assert flag in help_text, path
        assert flag_help(cls, field.name), f"{path} has no help"
        value = _other_value(cls, field)
        assert value != field.default, path
        values[path] = value
        argv += _typed(cls, field.name, value)
        _merge(data, _nested(path, list(value) if isinstance(value, tuple) else value))
    assert len(values) > 80
    file = tmp_path / "every.yaml"
    file.write_text(yaml.safe_dump(data))
    for config in (parse_config(argv), parse_config(["--config", str(file)])):
        assert {path: _get(config, path) for path in values} == values
    toml = tmp_path / "serve.toml"
    toml.write_text('[engine]\nmax_num_seqs = 7\n[online.trainer]\nlr = 1e-3\n')
    config = parse_config(["--config", str(toml)])
    assert (config.engine.max_num_seqs, config.online.trainer.lr) == (7, 1e-3)


def test_flags_override_the_file(tmp_path):
    file = tmp_path / "serve.yaml"
    file.write_text("engine: {max_num_seqs: 7}\nonline: {enabled: false, trainer: {lr: 1.0e-3}}\n")
    config = parse_config(["--max-num-seqs", "3", "--config", str(file), "--train"])
    assert (config.engine.max_num_seqs, config.online.enabled, config.online.trainer.lr) == (3, True, 1e-3)


def test_older_spellings_still_work():
    config = parse_config(["--enforce-eager", "--train-no-replay", "--train-no-gate", "--no-train"])
    assert config.engine.compile_decode is False
    assert not config.online.trainer.replay and not config.online.gate.enabled and not config.online.enabled


# Every check of the tree, as a user trips it: the flag and the message it must name.
BAD_FLAGS = [
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer (got 0)"),
    (["--max-model-len", "0"], "--max-model-len must be a positive integer"),
    (["--block-size", "0"], "--block-size must be a positive integer"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be a positive integer"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be a positive integer"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens must be at least"),
    (["--max-waiting", "0"], "--max-waiting must be a positive integer"),
    (["--slo-tpot-ms", "-1"], "--slo-tpot-ms must be >= 0 (got -1)"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be >= 0 (got -5)"),
    (["--record-fraction", "1.5"], "--record-fraction must be in [0, 1] (got 1.5)"),
    (["--route-threshold", "1.5"], "--route-threshold must be in [0, 1] (got 1.5)"),
    (["--record-budget-mb", "-1"], "--record-budget-mb must be an integer >= 0 (got -1)"),
    (["--record-host-budget-mb", "-2"], "--record-host-budget-mb must be an integer >= 0 (got -2)"),
    (["--record-disk-budget-mb", "-1"], "--record-disk-budget-mb must be an integer >= 0"),
    (["--record-dir", " "], "--record-dir must not be empty"),
    (["--record-ttl-s", "0"], "--record-ttl-s must be positive"),
    (["--train-lr", "0"], "--train-lr must be positive"),
    (["--train-weight-decay", "-1"], "--train-weight-decay must be >= 0"),
    (["--train-betas", "1", "0.9"], "--train-betas must be two numbers in [0, 1)"),
    (["--train-max-grad-norm", "-1"], "--train-max-grad-norm must be >= 0"),
    (["--train-max-staleness", "-1"], "--train-max-staleness must be an integer >= 0"),
    (["--train-prefetch-depth", "-1"], "--train-prefetch-depth must be an integer >= 0"),
    (["--train-group-size", "0"], "--train-group-size must be a positive integer"),
    (["--train-group-max-tokens", "-1"], "--train-group-max-tokens must be an integer >= 0"),
    (["--train-batch-size", "0"], "--train-batch-size must be a positive integer"),
    (["--train-epochs", "0"], "--train-epochs must be a positive integer"),
    (["--lora-r", "0"], "--lora-r must be a positive integer"),
    (["--lora-preference-r", "-1"], "--lora-preference-r must be an integer >= 0"),
    (["--lora-alpha", "0"], "--lora-alpha must be positive"),
    (["--keep-adapter-versions", "0"], "--keep-adapter-versions must be a positive integer"),
    (["--train-anchor-samples", "0"], "--train-anchor-samples must be a positive integer"),
    (["--train-anchor-known-facts", "-1"], "--train-anchor-known-facts must be an integer >= 0"),
    (["--train-rehearse-corrections", "-1"], "--train-rehearse-corrections must be an integer >= 0"),
    (["--train-rehearse-max-tokens", "-1"], "--train-rehearse-max-tokens must be an integer >= 0"),
    (["--train-anchor-top-k", "0"], "--train-anchor-top-k must be a positive integer"),
    (["--train-anchor-max-tokens", "0"], "--train-anchor-max-tokens must be a positive integer"),
    (["--train-anchor-pool-size", "0"], "--train-anchor-pool-size must be a positive integer"),
    (["--train-anchor-turn", "0"], "--train-anchor-turn must be a positive integer"),
    (["--train-anchor-weight", "-1"], "--train-anchor-weight must be >= 0"),
    (["--train-sft-weight", "-1"], "--train-sft-weight must be >= 0"),
    (["--train-kto-weight", "-1"], "--train-kto-weight must be >= 0"),
    (["--train-dpo-weight", "-1"], "--train-dpo-weight must be >= 0"),
    (["--train-kto-desirable-weight", "-1"], "--train-kto-desirable-weight must be >= 0"),
    (["--train-kto-undesirable-weight", "-1"], "--train-kto-undesirable-weight must be >= 0"),
    (["--train-kto-beta", "0"], "--train-kto-beta must be positive"),
    (["--train-dpo-beta", "0"], "--train-dpo-beta must be positive"),
    (["--train-skip-ratings-after-s", "-1"], "--train-skip-ratings-after-s must be >= 0"),
    (["--train-skip-corrections-after-s", "-1"], "--train-skip-corrections-after-s must be >= 0"),
    (["--train-loss-spike-factor", "-1"], "--train-loss-spike-factor must be >= 0"),
    (["--train-loss-spike-warmup", "-1"], "--train-loss-spike-warmup must be an integer >= 0"),
    (["--train-target-loss", "-1"], "--train-target-loss must be >= 0"),
    (["--train-max-wait-s", "-1"], "--train-max-wait-s must be >= 0"),
    (["--train-yield-after-s", "-1"], "--train-yield-after-s must be >= 0"),
    (["--train-anchor-max-rows", "-1"], "--train-anchor-max-rows must be an integer >= 0"),
    (["--train-seed", "-1"], "--train-seed must be an integer >= 0"),
    (["--train-gate-heldout-max-rise", "0"], "--train-gate-heldout-max-rise must be positive"),
    (["--train-gate-canary-max-drop", "0"], "--train-gate-canary-max-drop must be positive"),
    (["--train-gate-canary-max-mean-drop", "0"], "--train-gate-canary-max-mean-drop must be positive"),
    (["--train-gate-taught-max-rise", "0"], "--train-gate-taught-max-rise must be positive"),
    (["--train-gate-taught-samples", "-1"], "--train-gate-taught-samples must be an integer >= 0"),
    (["--train-rollback-min-ratings", "-1"], "--train-rollback-min-ratings must be an integer >= 0"),
    (["--train-rollback-margin", "-0.1"], "--train-rollback-margin must be >= 0"),
    (["--train-rollback-z", "-1"], "--train-rollback-z must be >= 0"),
    (["--train-protect-energy", "1"], "--train-protect-energy must be in [0, 1)"),
    (["--train-target-token-p", "1"], "--train-target-token-p must be in [0, 1)"),
    (["--train-key-share", "0"], "--train-key-share must be in (0, 1]"),
    (["--port", "70000"], "--port must be an integer in 0..65535"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be a positive integer"),
    (["--max-completions-kept", "0"], "--max-completions-kept must be a positive integer"),
    (["--completion-ttl-s", "0"], "--completion-ttl-s must be positive"),
    (["--data-dir", " "], "--data-dir must not be empty"),
    (["--feedback-db", " "], "--feedback-db must not be empty"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--rate-limit-requests", "-1"], "--rate-limit-requests must be >= 0"),
    (["--rate-limit-feedback", "-1"], "--rate-limit-feedback must be >= 0"),
    (["--max-streams-per-key", "-1"], "--max-streams-per-key must be an integer >= 0"),
    (["--record-quota-mb-per-hour", "-1"], "--record-quota-mb-per-hour must be >= 0"),
    (["--host", "0.0.0.0"], "--host is not a loopback address"),
    (["--lora-modules", "team-a"], "--lora-modules entries must be NAME=PATH"),
    (["--lora-modules", "a=/x", "a=/y"], "--lora-modules names an adapter twice"),
    (["--max-loras", "0"], "--max-loras must be a positive integer"),
    (["--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras must be at least max_loras (4)"),
    (["--replicas", "0"], "--replicas must be a positive integer"),
    (["--ray-address", " "], "--ray-address must not be empty"),
    (["--replicas", "2"], "--replicas above 1 needs a feedback log the replicas share"),
]
# Checked by the parser's types before any check runs (choices, numbers, bools): its error names the flag too.
BAD_TYPES = [
    ["--dtype", "float16"], ["--device", "tpu"], ["--record-policy", "x"], ["--record-dtype", "float16"],
    ["--record-evict-priority", "fifo"], ["--train-thumbs-up", "x"], ["--metrics-access", "x"],
    ["--docs-access", "x"], ["--allocator", "tcmalloc"], ["--compile-decode", "yes"],
    ["--max-num-seqs", "2.5"], ["--train-lr", "fast"],
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[m.split()[0] for _, m in BAD_FLAGS])
def test_every_check_names_the_flag(argv, message):
    with pytest.raises(ValueError) as error:
        parse_config(argv)
    assert message in str(error.value)


@pytest.mark.parametrize("argv", BAD_TYPES, ids=[a[0] for a in BAD_TYPES])
def test_a_malformed_value_names_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as done:
        parse_config(argv)
    assert done.value.code == 2 and argv[0] in " ".join(capsys.readouterr().err.split())


def test_the_checks_cover_every_bounded_field():
    """Each field with a bound is tripped by one of BAD_FLAGS; the others are free (a name, a path) or a bool, a
    choice or an optional bool, which the parser's types hold (BAD_TYPES, and the file test below)."""
    tripped = {a for argv, _ in BAD_FLAGS for a in argv if a.startswith("--")} | {argv[0] for argv in BAD_TYPES}
    free = {"--model", "--api-keys-file"}
    for path, cls, field in leaves():
        flag, _ = flag_of(cls, field.name)
        assert flag in tripped or flag in free or field_type(cls, field.name) is bool, path


def test_file_errors_name_the_key(tmp_path):
    file = tmp_path / "serve.yaml"
    file.write_text("record: {store_budget_bytes: -1}\n")
    with pytest.raises(ValueError, match=r"record.store_budget_bytes in .*serve.yaml must be an integer >= 0"):
        parse_config(["--config", str(file)])
    file.write_text("engine: {max_num_sequences: 4}\n")
    with pytest.raises(ValueError, match="unknown setting engine.max_num_sequences"):
        parse_config(["--config", str(file)])
    file.write_text("online: {gate: {enabled: 1}}\n")
    with pytest.raises(ValueError, match="online.gate.enabled must be true or false"):
        parse_config(["--config", str(file)])
    # the user's flag is named when it is what set the value, even over a file's key
    file.write_text("record: {store_budget_bytes: 1024}\n")
    with pytest.raises(ValueError, match="^--record-budget-mb must be"):
        parse_config(["--config", str(file), "--record-budget-mb", "-1"])


def test_former_flat_keys_of_online_are_still_read_with_a_warning(tmp_path):
    """A config file written before OnlineConfig had sections: each former key (FORMER_KEYS) sets its field where it
    is now, with a FutureWarning naming the new key; set both ways, a setting is an error. All the former keys in one
    file (a parse builds tyro's parser anew: 0.1 s each)."""
    values = {}
    for old, new in FORMER_KEYS.items():
        section, name = new.split(".")
        cls = field_type(OnlineConfig, section)
        values[old] = _other_value(cls, next(f for f in dataclasses.fields(cls) if f.name == name))
    file = tmp_path / "former.yaml"
    file.write_text(yaml.safe_dump({"online": values}))
    with pytest.warns(FutureWarning) as warned:
        config = parse_config(["--config", str(file)])
    messages = " ".join(str(w.message) for w in warned)
    for old, new in FORMER_KEYS.items():
        assert f"online.{old} is now online.{new} " in messages, old
        assert _get(config, f"online.{new}") == values[old], old
    file = tmp_path / "both.yaml"
    file.write_text("online: {gate: false, gate_taught_samples: 3, epochs: 2, stopping: {target_loss: 0.5}}\n")
    with pytest.warns(FutureWarning):
        online = parse_config(["--config", str(file)]).online
    assert (online.gate.enabled, online.gate.taught_samples, online.stopping.epochs, online.stopping.target_loss) == (
        False, 3, 2, 0.5)  # fmt: skip
    file.write_text("online: {epochs: 2, stopping: {epochs: 3}}\n")
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="online.stopping.epochs is set twice"):
        parse_config(["--config", str(file)])


def test_retired_settings_are_read_with_a_warning_and_ignored(tmp_path):
    """The fixed share of training's time is gone (the latency objective replaced it): its flags and keys, flat or
    in their section, are still read, with a FutureWarning saying why, and change nothing."""
    for argv in (["--train-share", "0.5"], ["--train-share=0.5"], ["--train-quantum-ms", "40", "--no-train"]):
        with pytest.warns(FutureWarning, match="ignored: training's time follows the latency objective"):
            config = parse_config(argv)
        assert config.online == OnlineConfig(enabled="--no-train" not in argv)
    for data in ({"time_share": {"share": 0.3, "quantum_s": 0.04}}, {"train_share": 0.3, "train_quantum_s": 0.04}):
        file = tmp_path / "old.yaml"
        file.write_text(yaml.safe_dump({"online": {**data, "queue": {"batch_size": 3}}}))
        with pytest.warns(FutureWarning, match="online.t.* is ignored"):
            online = parse_config(["--config", str(file)]).online
        assert online == OnlineConfig(queue=QueueConfig(batch_size=3))


def test_the_latency_objective_flags_are_in_milliseconds():
    engine = parse_config(["--slo-tpot-ms", "40", "--slo-ttft-ms", "750"]).engine
    assert (engine.slo_tpot_s, engine.slo_ttft_s) == (0.04, 0.75)
    assert (parse_config([]).engine.slo_tpot_s, parse_config([]).engine.slo_ttft_s) == (0.0, 0.0)  # derived
