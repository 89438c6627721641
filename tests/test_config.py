"""Presets load, the full study's numbers are frozen, and bad values are refused
with one line and exit 2."""

from __future__ import annotations

import json

import pytest
import yaml

from coopstudy import config, machine, workspace
from coopstudy.errors import ConfigError


@pytest.mark.parametrize("preset", config.preset_names())
def test_every_preset_loads(preset):
    cfg = config.load(preset)
    assert cfg.preset == preset
    flat = config.flatten(cfg)
    assert flat["train.global_batch"] == str(cfg.train.global_batch)
    assert all(isinstance(v, str) for v in flat.values())


def test_presets_present():
    assert {"tiny", "smollm2-135m-cpu", "smollm2-1.7b"} <= set(config.preset_names())


def test_full_study_numbers():
    cfg = config.load("smollm2-1.7b")
    d, t = cfg.data, cfg.train
    assert len(d.families) == 4
    assert len(d.families) * d.tasks_per_family == 6144
    assert d.replay_docs == 2048
    assert cfg.train_documents == 8192
    assert len(d.families) * d.test_per_family == 1024
    assert d.retention_docs == 128
    assert (t.global_batch, t.updates, t.lr, t.warmup_updates) == (256, 128, 3e-5, 8)
    assert t.updates * t.global_batch == 4 * cfg.train_documents  # four passes
    assert d.max_context == 1024
    assert (d.answer_weight, d.replay_weight) == (8.0, 1.0)
    assert (cfg.arms.control.workers, cfg.arms.control.microbatch) == (1, 16)
    assert (cfg.arms.compressed.workers, cfg.arms.compressed.microbatch) == (2, 8)
    assert (cfg.powersgd.rank, cfg.powersgd.dense_updates) == (32, 8)
    assert t.updates - cfg.powersgd.dense_updates == 120
    assert cfg.model.source == "pretrained" and "1.7B" in cfg.model.name_or_path
    s = cfg.screens
    assert (s.min_accuracy_gain, s.retention_max_nll_increase, s.noninferiority_margin, s.min_speedup) == (
        0.10, 0.02, -0.03, 1.10)
    assert cfg.budget.allocation_usd == 100.0


def test_default_preset_is_the_cpu_preset():
    from coopstudy.cli import DEFAULT_PRESET

    assert DEFAULT_PRESET == "smollm2-135m-cpu"
    assert config.load(DEFAULT_PRESET).model.source == "gguf-package"


def test_overrides_are_typed():
    cfg = config.load("tiny", ["train.lr=2e-4", "data.families=[gcd, products]", "train.grad_clip=1.0"])
    assert cfg.train.lr == 2e-4
    assert cfg.data.families == ("gcd", "products")
    assert cfg.train.grad_clip == 1.0


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lrr=1", "train.lrr: unknown key; did you mean train.lr?"),
        ("train.learning_rate=1", "train.learning_rate: unknown key; train takes: updates, global_batch, lr, "),
        ("train.updates=abc", "train.updates: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
        ("train.updates=-3", "train.updates: Input should be greater than 0"),
        ("train.updates=0", "train.updates: Input should be greater than 0"),
        ("data.replay_docs=-1", "data.replay_docs: Input should be greater than or equal to 0 (got -1)"),
        ("train.global_batch=7", "train.global_batch: 7 does not split evenly over arms.compressed.workers=2"),
        ("arms.compressed.microbatch=5", "arms.compressed.microbatch: 5 is larger than the local batch (8 / 2 workers = 4)"),
        ("train.precision=fp8", "train.precision: Input should be 'auto', 'bf16', 'fp32' or 'fp64' (got 'fp8')"),
        ("data.max_context=4", "data.max_context: Input should be greater than 16 (got 4)"),
        ("train.warmup_updates=99", "train.warmup_updates: 99 exceeds train.updates=6"),
        ("noequals", "expected key=value"),
        # A list left open was text, said as "Input should be a valid tuple".
        ("data.families=[gcd, products", "'[gcd, products' is not a YAML list or mapping (expected ',' or ']', but got '<stream end>'); close its brackets"),
        # YAML reads 123 as a number; the line says how to write the name.
        ("experiment=123", """experiment: Input should be a valid string (got 123); YAML read it as a number: put it in quotes to mean text (with --set, inside the shell's word: --set 'experiment="..."')"""),
        # Infinity passes `> 0` and fails far later (a timeout of inf overflows).
        ("train.lr=inf", "train.lr: Input should be a finite number"),
        ("screens.min_speedup=nan", "screens.min_speedup: Input should be a finite number"),
        ("distributed.collective_timeout_s=.inf", "distributed.collective_timeout_s: Input should be a finite number"),
        ("train.updates=true", "train.updates: expected a number, not a boolean"),
        # Passed to the model, it fails inside the first forward's rotary embedding.
        (("model.hidden_size=6", "model.num_heads=2", "model.num_kv_heads=2"), "model.hidden_size: 6 / num_heads=2 is 3 dimensions per head"),
        # The arms the protocol compares, or the screens would judge something else under their names.
        ("arms.control.workers=2", "arms.control.workers: the control is the single-device arm, 1 worker, not 2"),
        ("arms.compressed.workers=1", "arms.compressed.workers: the compressed arm's gradients travel between workers: at least 2"),
        ("powersgd.dense_updates=6", "powersgd.dense_updates: 6 dense updates of train.updates=6 leave the compressed arm no compressed update"),
        # A probe that never compresses chooses a microbatch without PowerSGD's memory.
        ("probe.updates=2", "probe.updates: 2 update(s) leave a compressed probe no compressed update, and its memory none of PowerSGD's"),
        # Hints load the config again as `--preset NAME`: renamed, they would load another preset.
        ("preset=smollm2-135m-cpu", "override 'preset=smollm2-135m-cpu': a config's name is the preset it loads"),
        # Before, each of these was taken as YAML 1.1 read it, unseen: `run #3` as `run`,
        # 010 as 8, 0x10 as 16, 1:2 as 62; a later --set of a key won over the first.
        ("experiment=run #3", "override 'experiment=run #3': YAML reads ' #' as a comment and would drop it; put the value in quotes"),
        ("train.updates=010", "override 'train.updates=010': YAML reads '010' as 8; write the number in decimal, or put it in quotes to mean text"),
        ("train.updates=0x10", "YAML reads '0x10' as 16"),
        ("experiment=1:2", "YAML reads '1:2' as 62"),
        ("train.lr=1:2.5", "YAML reads '1:2.5' as 62.5"),
        (("train.lr=1e-4", "train.lr=2e-4"), "override 'train.lr=2e-4': train.lr is given twice (first 'train.lr=1e-4')"),
        # Before, "Input should be a valid string" and nothing on how to write it, or YAML's own words alone.
        ("experiment=~", "experiment: Input should be a valid string (got None); YAML read it as null: put it in quotes to mean text"),
        ("experiment=lr: 1e-4", "experiment: Input should be a valid string; YAML read it as a mapping: put it in quotes to mean text"),
        ("experiment==", "override 'experiment==': could not determine a constructor for the tag 'tag:yaml.org,2002:value'; put the value in quotes to mean text"),
        # Before, a traceback from MLflow's store (a surrogate cannot be encoded), or an experiment named so.
        ('experiment="\\udcff"', "experiment: a name with a control character, a line break or bytes that are not UTF-8 (got '\\udcff')"),
        ('experiment="a\\nb"', "experiment: a name with a control character, a line break or bytes that are not UTF-8 (got 'a\\nb')"),
        ('experiment="a\\0b"', "experiment: a name with a control character, a line break or bytes that are not UTF-8"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        config.load("tiny", [override] if isinstance(override, str) else list(override))
    message = str(err.value)
    assert key in message
    assert "\n" not in message


def test_what_yaml_reads_as_the_value_shown_is_taken():
    cfg = config.load("tiny", ["train.updates=1_000", 'experiment="run #3"', "data.families=[gcd, products]", "train.lr=0.5e-3"])
    assert (cfg.train.updates, cfg.experiment, cfg.data.families) == (1000, "run #3", ("gcd", "products"))
    # Names in any script, spaces and joined emoji included: only control characters and line breaks are refused.
    for name in ("実験\u30001", "team\u00a0a", "team 👩\u200d💻"):
        assert config.load("tiny", [f"experiment={json.dumps(name, ensure_ascii=False)}"]).experiment == name


def test_a_list_item_read_as_a_number_gets_no_set_form_for_its_place():
    # `--set 'data.families.1="123"'` is refused: a list item's place is no key.
    with pytest.raises(ConfigError) as err:
        config.load("tiny", ["data.families=[gcd, 123]"])
    assert str(err.value).endswith("data.families.1: Input should be a valid string (got 123); YAML read it as a number: put it in quotes to mean text")


def test_cli_refuses_bad_config_with_one_line(cli):
    res = cli("prepare", "--preset", "tiny", "--set", "arms.control.microbatch=99", "--dry-run")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "arms.control.microbatch" in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "content, said",
    [
        ("- model\n- data\n", "expected a mapping of sections, got a list"),
        ("tiny\n", "expected a mapping of sections, got a str"),
        (b"model:\n  source: \xff\n", "not UTF-8 text"),
    ],
)
def test_a_preset_file_that_is_no_config_is_one_line(content, said, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as err:
        config.load(str(path))
    assert str(err.value) == f"preset {path}: {said}"


def test_a_preset_path_that_does_not_exist_is_no_such_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        config.load(str(tmp_path / "mine.yaml"))
    assert str(err.value) == f"preset {tmp_path / 'mine.yaml'}: no such file"


def test_a_preset_file_is_named_again_by_its_path(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text((workspace.project_root() / "configs" / "tiny.yaml").read_text() + "preset: exp1\n")
    cfg = config.load(str(mine))
    # The hints' `--preset` must load it again: the file, whatever name it gives itself.
    assert (cfg.preset, cfg.preset_argument) == ("exp1", str(mine))
    assert config.load("tiny").preset_argument == "tiny"


def test_a_preset_file_that_names_itself_with_a_number_is_told_to_quote_it_in_the_file(tmp_path):
    # Before, the line also offered `--set 'preset="..."'`, which is then refused: --set takes no preset.
    mine = tmp_path / "mine.yaml"
    mine.write_text((workspace.project_root() / "configs" / "tiny.yaml").read_text() + "preset: 5\n")
    with pytest.raises(ConfigError) as err:
        config.load(str(mine))
    assert str(err.value).endswith("preset: Input should be a valid string (got 5); YAML read it as a number: put it in quotes to mean text")


def test_overrides_in_one_word_may_hold_values_with_spaces(cli):
    # `mlflow run -P overrides=...` hands every override over as one word.
    res = cli("prepare", "--preset", "tiny", "--set", "data.families=[gcd, products]  train.lr=2e-4", "--dry-run")
    assert res.returncode == 0, res.stderr
    cfg = config.Config.model_validate(yaml.safe_load(res.stdout))
    assert (cfg.data.families, cfg.train.lr) == (("gcd", "products"), 2e-4)


def test_cli_unknown_preset(cli):
    res = cli("prepare", "--preset", "nope", "--dry-run")
    assert res.returncode == 2
    assert "unknown preset 'nope'" in res.stderr and "tiny" in res.stderr


def test_outside_the_project_a_preset_name_says_where_presets_are_looked_for(cli, tmp_path):
    # Presets are the project's configs/: from a folder outside it, a name
    # finds none, and the line says where it looked and what to do.
    res = cli("prepare", "--preset", "tiny", "--dry-run", env={"COOPSTUDY_HOME": str(tmp_path / "home")}, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"coopstudy prepare: error: no presets in {tmp_path.resolve() / 'configs'}: run from the project "
        "(a folder with MLproject, or below it), or give --preset a path to a YAML file"
    )


def test_dry_run_prints_resolved_config(cli):
    res = cli("prepare", "--preset", "tiny", "--set", "train.lr=0.5", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "lr: 0.5" in res.stdout


def test_dev_split_dry_run_prints_the_development_config_it_runs(cli):
    # Before, it printed the preset's families and test seed, not the ones it trains and scores under.
    from coopstudy.inputs import tasks

    res = cli("dev-split", "--preset", "tiny", "--families", "gcd", "--dry-run")
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    assert shown["data"]["families"] == ["gcd"] and shown["data"]["test_seed"] == tasks.DEV_SEED


@pytest.mark.parametrize(
    "override, said",
    [
        ("data.families=[gcdd]", "data.families: reasoning-gym has no family 'gcdd'; did you mean gcd?"),
        ("data.family_options={gcd: {min_valu: 5}}", "data.family_options: reasoning-gym cannot make 'gcd': GCDConfig.__init__() got an unexpected keyword argument 'min_valu'"),
    ],
)
def test_dry_run_refuses_a_family_as_prepare_does(cli, override, said):
    res = cli("train", "--preset", "tiny", "--set", override, "--dry-run")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"coopstudy train: error: {said}\n"


@pytest.mark.parametrize(
    "argv, said",
    [
        (("study", "--arm", "control"), "--arm control: it applies only with --through train (got --through report)"),
        # What a step of the study refuses: before, the study refused it only after prepare and verify had run.
        (("study", "--set", "probe.updates=7"), "probe.updates: 7 exceeds train.updates=6"),
        pytest.param(
            ("study", "--through", "train", "--arm", "compressed", "--set", "distributed.backend=nccl"),
            "distributed.backend: nccl needs CUDA, and this machine has none",
            marks=pytest.mark.skipif(machine.cuda_available(), reason="this machine has CUDA"),
        ),
        (("train", "--nodes", "0"), "--nodes 0: a job runs on at least 1 host"),
        (("train", "--arm", "control", "--hostfile", "hosts"), "--hostfile: only the compressed arm runs on several hosts (got --arm control)"),
        (("probe", "--set", "probe.candidates=[{arm: control, microbatch: 100}]"), "config tiny: arms.control.microbatch: 100 is larger than the local batch"),
        pytest.param(
            ("train", "--set", "distributed.backend=nccl"), "distributed.backend: nccl needs CUDA, and this machine has none",
            marks=pytest.mark.skipif(machine.cuda_available(), reason="this machine has CUDA"),
        ),
        # Before, the tools' and report's dry runs printed the config and exited 0.
        (("dev-split", "--lrs", "-1"), "--lrs: each learning rate must be a positive number"),
        (("dev-split", "--families", "gcdd"), "--families: reasoning-gym has no family 'gcdd'; did you mean gcd?"),
        (("bench objective", "--updates", "6"), "--updates: between 1 and train.updates - 1 (5; one warm-up update comes first), not 6"),
        (("bench arms", "--updates", "0"), "--updates: between 1 and train.updates (6), not 0"),
        (("bench generate", "--items", "0"), "--items: from 1 to 100,000 (got 0)"),
        (("report", "--plan", "xyz"), "--plan 'xyz': expected the plan's sha256 (64 hex digits, or the first 12 or more)"),
        # Passed under --dry-run, then refused by the step as "File exists".
        (("report", "--out", "/dev/null"), "report folder /dev/null: cannot make it (a file is there, not a folder)"),
        # Before, each passed --dry-run and prepare refused it.
        (("prepare", "--set", "data.replay_source=/nonexistent/x.jsonl"), "data.replay_source: /nonexistent/x.jsonl does not exist"),
        (("prepare", "--set", "model.source=gguf-package", "model.gguf_package=nosuchpkg"), "model.gguf_package: package 'nosuchpkg' is not installed"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else "",
)
def test_dry_run_refuses_what_the_step_refuses_before_any_work(cli, argv, said, tmp_path):
    command, *rest = argv
    (tmp_path / "hosts").write_text("host-a slots=1\nhost-b slots=1\n")
    rest = [str(tmp_path / a) if a == "hosts" else a for a in rest]
    dry = cli(*command.split(), "--preset", "tiny", *rest, "--dry-run")
    assert (dry.returncode, dry.stdout) == (2, ""), dry.stderr
    assert dry.stderr.startswith(f"coopstudy {command}: error: {said}"), dry.stderr
    # The same line as the step itself, before it does anything.
    real = cli(*command.split(), "--preset", "tiny", *rest)
    assert (real.returncode, real.stderr.splitlines()[-1:]) == (2, dry.stderr.splitlines()), real.stderr[-3000:]


@pytest.mark.parametrize("native, resolved", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_resolves_on_load(monkeypatch, native, resolved):
    monkeypatch.setattr(machine, "native_bf16", lambda: native)
    cfg = config.load("smollm2-135m-cpu")
    assert cfg.train.precision == resolved
    assert config.flatten(cfg)["train.precision"] == resolved
    # The resolved config travels to workers as it is: loading it again keeps it.
    assert config.from_dict(cfg.model_dump(mode="json")).train.precision == resolved


def test_dry_run_prints_the_resolved_precision(cli):
    res = cli("prepare", "--preset", "smollm2-135m-cpu", "--dry-run")
    assert res.returncode == 0, res.stderr
    expected = "bf16" if machine.native_bf16() else "fp32"
    assert f"precision: {expected}" in res.stdout
    assert "precision: auto" not in res.stdout
