"""`mlflow run` is the front door: typed as the README types it, in a fresh
copy of the project with no MLflow or coopstudy variables set, every run of a
step lands in one experiment of one store, whichever way the step started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml
from fixtures import ROOT, checkout_copy, run_cli, run_worker

from coopstudy import config
from coopstudy.record import schema, store

pytestmark = pytest.mark.slow


class Project:
    """A fresh copy of the project, used as a new user uses it: from its folder,
    with the environment's `mlflow` and no tracking variables."""

    def __init__(self, root: Path, seed_home: Path):
        self.root = root
        # A fresh clone makes the tiny seed in its first prepare; this copies it in.
        shutil.copytree(seed_home, root / ".coopstudy")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "COOPSTUDY_HOME"}
        self.env |= {
            "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }

    def run(self, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)

    def mlflow_run(self, entry: str, *args: str) -> subprocess.CompletedProcess:
        done = self.run("mlflow", "run", ".", "-e", entry, "--env-manager", "local", *args)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    @property
    def local(self) -> mlflow.MlflowClient:
        return mlflow.MlflowClient(tracking_uri=f"sqlite:///{self.root / 'mlflow.db'}")


def _runs(client: mlflow.MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.fixture
def project(tmp_path, tiny_seed_home) -> Project:
    return Project(checkout_copy(tmp_path / "project"), tiny_seed_home)


def test_prepare_twice_through_mlflow_run_records_two_runs_in_the_study_experiment(project):
    for _ in range(2):
        project.mlflow_run("prepare", "-P", "preset=tiny")
    prepares = _runs(project.local, "coopstudy")
    assert [r.info.status for r in prepares] == ["FINISHED", "FINISHED"]
    assert len({r.data.tags[schema.TAG_INPUTS] for r in prepares}) == 1
    exp = project.local.get_experiment_by_name("coopstudy")
    assert exp.tags[store.EXPERIMENT_KIND_TAG] == store.EXPERIMENT_KIND
    # What `mlflow run` made in Default is a pointer to each real run, nothing more.
    pointers = _runs(project.local, "Default")
    assert sorted(p.data.tags[schema.TAG_RECORD_RUN] for p in pointers) == sorted(r.info.run_id for r in prepares)
    assert all(p.info.status == "FINISHED" and not p.data.metrics for p in pointers)
    assert all(p.data.tags[schema.TAG_RECORD_RUN] in p.data.tags["mlflow.note.content"] for p in pointers)
    # The study's files are the project's own.
    assert (project.root / ".coopstudy" / "ledger.jsonl").is_file()


def test_a_preset_file_and_an_experiment_named_to_mlflow_run(project, tmp_path):
    preset = tmp_path / "my-preset.yaml"
    shutil.copy(project.root / "configs" / "tiny.yaml", preset)
    project.mlflow_run("prepare", "--experiment-name", "mine", "-P", f"preset={preset}")
    (run,) = _runs(project.local, "mine")
    # Named to mlflow run, the experiment is the study's: its run is the record itself.
    assert run.info.status == "FINISHED" and schema.TAG_RECORD_RUN not in run.data.tags
    assert run.data.params["preset"] == str(preset) and run.data.tags[schema.TAG_PRESET] == "my-preset"
    assert not _runs(project.local, "coopstudy")


def test_mlflow_runs_own_run_is_the_record_under_a_relative_sqlite_uri(project):
    # The step names the file from the root; `mlflow run`'s run is still in the same store.
    project.env["MLFLOW_TRACKING_URI"] = "sqlite:///mine.db"
    project.mlflow_run("prepare", "--experiment-name", "mine", "-P", "preset=tiny")
    (run,) = _runs(mlflow.MlflowClient(tracking_uri=f"sqlite:///{project.root / 'mine.db'}"), "mine")
    assert run.info.status == "FINISHED" and schema.TAG_RECORD_RUN not in run.data.tags
    assert run.data.tags[schema.TAG_STAGE] == schema.STAGE_PREPARE


def test_a_relative_sqlite_uri_and_home_are_one_store_and_home_for_a_step_and_the_ranks_it_starts(tmp_path, probed_tiny_store):
    # Ranks run in the project folder; a step started below it names its file
    # and home from there, and the ranks must record in that file and read that
    # home, not ones of their own (before, a relative home sent the ranks to
    # another, and they refused: "no inputs commitment").
    root = checkout_copy(tmp_path / "project")
    below = root / "notes"
    below.mkdir()
    shutil.copy(probed_tiny_store.db, below / "study.db")
    shutil.copytree(probed_tiny_store.home, below / "home")
    env = {"MLFLOW_TRACKING_URI": "sqlite:///study.db", "COOPSTUDY_HOME": "home"}
    for step in (("plan",), ("train", "--arm", "control")):
        done = run_cli(*step, "--preset", "tiny", env=env, cwd=below)
        assert done.returncode == 0, done.stderr[-3000:]
    assert not (root / "study.db").exists() and not (root / "home").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{below / 'study.db'}")
    (trained,) = [r for r in _runs(client, "coopstudy") if r.data.tags.get(schema.TAG_STAGE) == schema.STAGE_TRAIN]
    assert trained.info.status == "FINISHED"
    assert len(client.get_metric_history(trained.info.run_id, schema.M_LOSS)) == config.load("tiny").train.updates
    # analysis/ is not installed with the package: a tool that reads the record with it finds it from below the root too.
    benched = run_cli("bench", "arms", "--preset", "tiny", "--arm", "control", "--updates", "1", env=env, cwd=below)
    assert benched.returncode == 0, benched.stderr[-3000:]
    assert "bench arms: control, 1 process, 1 updates" in benched.stdout, benched.stdout[-3000:]


def test_no_entry_point_parameter_is_also_a_config_param():
    from coopstudy.record import writer

    logged = {k for k in config.flatten(config.load("tiny")) if k not in writer.NOT_PARAMS}
    entries = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"]
    declared = {name for entry in entries.values() for name in entry.get("parameters", {})}
    assert "preset" in declared
    assert not declared & logged


@pytest.mark.parametrize(
    "argv, said",
    [
        (("bench", "arms", "--help"), "each launched exactly as `train` launches it"),
        (("bench", "generate", "--help"), "checks that\nboth give the same tokens"),
        (("dev-split", "--help"), "beside the study's own screens on the split"),
        (("remote", "--help"), "check    run that preflight alone"),
        (("remote", "check", "--help"), "the experiment that must take writes"),
    ],
)
def test_help_of_a_tool_says_what_it_does(cli, argv, said):
    done = cli(*argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert said in done.stdout


def test_help_lists_every_command_without_loading_torch(cli):
    # `coopstudy --help` is a researcher's first command: it answers in a
    # fraction of a second because no listed command's module imports torch to describe itself.
    from coopstudy import cli as parser

    done = cli("--help")
    assert done.returncode == 0, done.stderr[-3000:]
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("    ") and line[4] != " "]
    assert listed == [*parser.STEPS, *parser.TOOLS]
    heavy = ("torch", "transformers", "mlflow", "pandas")
    probe = f"import sys; from coopstudy import cli; cli.build_parser(); print(sorted(set({heavy!r}) & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == "[]"


def test_version_says_the_installed_package(cli):
    from importlib import metadata

    done = cli("--version")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"coopstudy {metadata.version('coopstudy')}"


@pytest.mark.skipif(bool(os.environ.get("COOPSTUDY_TEST_FRESH")), reason="every command runs fresh")
def test_a_command_forked_warm_says_what_a_fresh_one_says(cli, tiny_seed, tmp_path):
    # run_cli forks most commands from a warm interpreter (tests/warm_cli.py):
    # the suite's refusals then say what they say to a user only if this holds.
    from fixtures import _WARM

    cases = [
        ("--help",),
        ("prepare", "--preset", "nosuch"),
        ("train", "--preset", "tiny", "--hostfile", str(tmp_path / "nosuch")),  # after the store opens
        ("select", "--preset", "tiny"),  # after the ledger and the record are read
        ("plan", "--preset", "tiny", "--dry-run", "--set", "train.lr=2e-4"),
    ]
    for argv in cases:
        served = _WARM.served
        warm = cli(*argv)
        assert _WARM.served == served + 1, argv  # not run fresh instead
        fresh = subprocess.run([sys.executable, "-m", "coopstudy", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), argv
    # The variables it is given are the command's: a store named here is the one it opens.
    elsewhere = cli("select", "--preset", "tiny", env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'other.db'}"})
    assert elsewhere.returncode == 2 and (tmp_path / "other.db").is_file(), elsewhere.stderr[-3000:]


@pytest.mark.skipif(bool(os.environ.get("COOPSTUDY_TEST_FRESH")), reason="every command runs fresh")
def test_a_command_forked_warm_in_a_copy_of_the_checkout_runs_the_copys_sources(cli, tmp_path):
    # A copy's commands fork warm too (test_study's copy edits its sources):
    # the child imports the project from where a fresh interpreter would.
    from fixtures import _WARM

    copy = checkout_copy(tmp_path / "copy")
    cli_py = copy / "src" / "coopstudy" / "cli.py"
    cli_py.write_text(cli_py.read_text() + "\nprint('the copy speaks')\n")
    env = {**os.environ, "PYTHONPATH": f"{copy / 'src'}{os.pathsep}{copy}"}
    for cwd, argv in ((copy, ("prepare", "--preset", "nosuch")), (copy / "scripts", ("--version",))):
        served = _WARM.served
        warm = cli(*argv, env=env, cwd=cwd, inherit=False)
        assert _WARM.served == served + 1, argv  # not run fresh instead
        fresh = subprocess.run([sys.executable, "-m", "coopstudy", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), argv
        assert warm.stdout.startswith("the copy speaks\n"), warm.stdout
    # A folder on the path whose hook a fresh interpreter runs as it starts: no fork can stand for it.
    hooked = tmp_path / "hooked"
    hooked.mkdir()
    (hooked / "sitecustomize.py").write_text("print('hooked')\n")
    served = _WARM.served
    done = cli("--version", env={**env, "PYTHONPATH": f"{hooked}{os.pathsep}{env['PYTHONPATH']}"}, cwd=copy, inherit=False)
    assert _WARM.served == served and done.stdout.startswith("hooked\n"), done.stdout


def test_two_projects_sharing_one_environment_keep_their_own_study_files(project, tmp_path, tiny_seed_home):
    other = Project(checkout_copy(tmp_path / "other"), tiny_seed_home)
    # The other copy runs this copy's package: one environment, two projects.
    other.env["PYTHONPATH"] = project.env["PYTHONPATH"]
    for p in (project, other):
        done = run_cli("prepare", "--preset", "tiny", env=p.env, cwd=p.root, inherit=False)
        assert done.returncode == 0, done.stderr[-3000:]
    for p in (project, other):
        ledger = (p.root / ".coopstudy" / "ledger.jsonl").read_text().splitlines()
        assert len(ledger) == 1 and (p.root / "mlflow.db").is_file()


def test_a_stores_artifacts_lie_beside_its_database_wherever_the_command_starts(project, tmp_path):
    db = tmp_path / "store" / "m.db"
    started_in = project.root / "scripts"
    env = project.env | {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    done = run_cli("prepare", "--preset", "tiny", env=env, cwd=started_in, inherit=False)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("coopstudy")
    # MLflow's default is ./mlruns of the working folder, which would scatter one store's checkpoints.
    assert exp.artifact_location == str(db.parent / store.ARTIFACTS_BESIDE_DATABASE / exp.experiment_id)
    (run,) = _runs(client, "coopstudy")
    assert (db.parent / store.ARTIFACTS_BESIDE_DATABASE / exp.experiment_id / run.info.run_id / "artifacts" / schema.ART_CONFIG).is_file()
    assert not (started_in / "mlruns").exists() and not (project.root / "mlruns").exists()


@pytest.mark.parametrize(
    "entry, params, said",
    [
        ("prepare", ("-P", "preset=tiny", "-P", "nosuch=1"), "-P nosuch: not a parameter of entry point prepare (it takes -P overrides, -P preset)"),
        # main and train both run `study`; each names its own parameters, not theirs together.
        ("main", ("-P", "preset=tiny", "-P", "nosuch=1"), "-P nosuch: not a parameter of entry point main (it takes -P overrides, -P preset)"),
        ("train", ("-P", "preset=tiny", "-P", "nosuch=1"), "-P nosuch: not a parameter of entry point train (it takes -P arm, -P overrides, -P preset)"),
        ("prepare", ("-P", "preset=nosuch"), "unknown preset 'nosuch'"),
        # Undeclared, though the command's step has such an option: not obeyed, nor --help printed.
        ("main", ("-P", "preset=tiny", "-P", "through=prepare"), "-P through: not a parameter of entry point main (it takes -P overrides, -P preset)"),
        ("verify", ("-P", "preset=tiny", "-P", "help=1"), "-P help: not a parameter of entry point verify (it takes -P overrides, -P preset)"),
        # Before, an option the command gives itself was taken as declared: the later --through won.
        ("train", ("-P", "preset=tiny", "-P", "through=report"), "-P through: not a parameter of entry point train (it takes -P arm, -P overrides, -P preset)"),
        ("probe", ("-P", "preset=tiny", "-P", "plan=1"), "-P plan: not a parameter of entry point probe (it takes -P overrides, -P preset)"),
        # A value the parser refuses is refused as the others are, mlflow run's run marked too.
        # ... and said as the -P that gave it.
        ("train", ("-P", "preset=tiny", "-P", "arm=nosuch"),
         "-P arm: invalid choice: 'nosuch' (choose from 'control', 'compressed', 'both') (entry point train of MLproject)"),
        # Before, a value that reads as an option was blamed on a -P dry-run the user never wrote.
        ("prepare", ("-P", "preset=tiny", "-P", "overrides=--dry-run"),
         "-P overrides: '--dry-run' starts with '-': a parameter gives a value, not an option (entry point prepare of MLproject)"),
    ],
    ids=["an unknown -P name", "an unknown -P name of main", "an unknown -P name of train", "an unknown preset", "-P of an option not declared", "-P help",
         "-P of an option the command gives", "-P of a flag the command gives",
         "a -P value the parser refuses", "a -P value that reads as an option"],  # fmt: skip
)
def test_a_refusal_through_mlflow_run_is_one_line_and_names_mlflow_runs_run(project, entry, params, said):
    done = project.run("mlflow", "run", ".", "-e", entry, "--env-manager", "local", *params)
    assert done.returncode == 1  # mlflow run's own code for any failure
    step = yaml.safe_load((project.root / "MLproject").read_text())["entry_points"][entry]["command"].split()[3]
    (line,) = [s for s in done.stderr.splitlines() if s.startswith("coopstudy")]
    assert line.startswith(f"coopstudy {step}: error: {said}"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # Refused before a run of its own: mlflow run's run says why, not a random name and nothing.
    (run,) = _runs(project.local, "Default")
    preset = params[1].removeprefix("preset=")
    assert (run.info.status, run.info.run_name) == ("FAILED", f"{step}-{preset} (refused)")
    assert run.data.tags[schema.TAG_ERROR] == line.removeprefix(f"coopstudy {step}: error: ")


def test_a_typo_by_hand_under_a_leftover_mlflow_run_id_is_told_as_the_cli_flag_and_leaves_that_run_alone(project):
    project.mlflow_run("prepare", "-P", "preset=tiny")
    (old,) = _runs(project.local, "Default")
    project.env |= {"MLFLOW_RUN_ID": old.info.run_id, "MLFLOW_TRACKING_URI": f"sqlite:///{project.root / 'mlflow.db'}"}
    done = run_cli("prepare", "--preset", "tiny", "--nosuch", "1", env=project.env, cwd=project.root, inherit=False)
    assert done.returncode == 2
    assert done.stderr.strip() == "coopstudy prepare: error: unrecognized arguments: --nosuch 1 (see `python -m coopstudy prepare --help`)"
    again = project.local.get_run(old.info.run_id)
    assert (again.info.status, again.info.run_name, again.data.tags) == (old.info.status, old.info.run_name, old.data.tags)


@pytest.mark.parametrize(
    "argv, said",
    [
        # argparse would take `tiny` for the command.
        (("--preset", "tiny", "prepare", "--dry-run"), "options go after the command: `python -m coopstudy prepare --preset tiny --dry-run`"),
        # argparse would say only that a command is missing.
        (("--bogus",), "unrecognized arguments: --bogus (a command comes first: see `python -m coopstudy --help`)"),
    ],
)
def test_options_before_the_command_are_one_line_saying_where_they_go(cli, argv, said):
    done = cli(*argv)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"coopstudy: error: {said}\n")


@pytest.mark.parametrize(
    "argv, said",
    [
        # argparse took `tiny` for the benchmark, and `x` for remote's command.
        (("bench", "--preset", "tiny", "objective"), "bench: error: options go after the bench command: `python -m coopstudy bench objective --preset tiny`"),
        (("remote", "--experiment", "x", "check"), "remote: error: options go after the remote command: `python -m coopstudy remote check --experiment x`"),
        # No benchmark named at all: argparse said `tiny` was no benchmark.
        (("bench", "--preset", "tiny", "--dry-run"), "bench: error: name the bench command first: `python -m coopstudy bench {objective,arms,generate} --preset tiny --dry-run`"),
        # Before, it offered `bench {objective,arms,generate} --version`, which every benchmark refuses.
        (("bench", "--version"), "bench: error: unrecognized arguments: --version (bench takes a command first, one of objective, arms, generate: see `python -m coopstudy bench --help`)"),
        # It pointed at `remote --help`, which does not list check's options.
        (("remote", "check", "extra"), "remote check: error: unrecognized arguments: extra (see `python -m coopstudy remote check --help`)"),
    ],
)
def test_options_before_a_subcommand_are_one_line_saying_where_they_go(cli, argv, said):
    done = cli(*argv)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"coopstudy {said}\n")


def test_every_help_says_where_the_files_and_the_runs_go(cli):
    # Every step's help spoke of <home>, and none said where it is.
    for argv in ((), ("prepare",), ("bench", "objective"), ("dev-split",)):
        done = cli(*argv, "--help")
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        assert "where things go: the study's files (<home>:" in text and "$COOPSTUDY_HOME" in text and "$MLFLOW_TRACKING_URI" in text, argv


@pytest.mark.parametrize(
    "argv, line",
    [
        (("remote",), "coopstudy remote: error: the following arguments are required: COMMAND (see `python -m coopstudy remote --help`)"),
        # Before, on a local store, "not a server; nothing to check" and exit 0, whatever the name.
        (("remote", "check", "--experiment", "Default"),
         "coopstudy remote check: error: --experiment 'Default': Default is MLflow's own experiment, where `mlflow run` puts its pointer runs; name the study's own"),
        # Before, "no records wait" and exit 0 where nothing waited.
        (("remote", "deliver", "--tracking-uri", "nosuch://x"),
         "coopstudy remote deliver: error: tracking URI 'nosuch://x' (from --tracking-uri) cannot be opened. Supported URI schemes are: "),
    ],
    ids=["remote without its command", "remote check of a name no step takes, on a local store", "remote deliver to a URI no store opens"],
)
def test_a_tool_given_too_little_is_one_line(cli, argv, line):
    done = cli(*argv)
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(said) == 1 and said[0].startswith(line), done.stderr[-3000:]


@pytest.mark.parametrize(
    "argv, line",
    [
        # Started by hand with a word no stage made: zlib's error would end in a traceback.
        (("--arm", "control", "--config", "nonsense", "--run-id", "0" * 32),
         "coopstudy worker (control, rank 0): --config: not a config encode_config made (the worker is started by train, probe and bench arms)"),
        (("--arm", "contrl", "--config", "nonsense", "--run-id", "0" * 32),
         "coopstudy worker: error: argument --arm: invalid choice: 'contrl' (choose from 'control', 'compressed')"),
    ],
    ids=["--config nonsense", "--arm misspelt"],
)
def test_a_worker_started_by_hand_with_bad_arguments_is_one_line(argv, line):
    done = run_worker(*argv)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [line], done.stderr[-3000:]


def test_the_worker_is_no_command_of_the_command_line(cli):
    # A training process starts at its own entry, which the plan binds (commit.sources.WORKER).
    done = cli("worker", "--arm", "control")
    assert done.returncode == 2 and "invalid choice: 'worker'" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
