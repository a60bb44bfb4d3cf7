"""Hydra at the edge: Hydra's own command line (``--help``, ``--cfg``, ``-m``...), one-line failures, the run dir.

`run_app` hands the command line to Hydra's ``@hydra.main`` machinery, so every Hydra flag works, after a
pre-flight that composes and validates every run first (each sweep point under ``-m``): a bad override
(unknown group option or key, wrong type, failed validation) becomes one line on stderr and exit status 2,
before any process group or data exists. Every torchrun rank resolves the same run directory:

- ``hydra.run.dir=DIR`` (``hydra.sweep.dir=DIR`` under ``-m``) wins;
- otherwise ``outputs/<date>/<time>`` (``multirun/...``) for a single process, and ``outputs/torchrun-<run id>``
  under torchrun (all ranks share TORCHELASTIC_RUN_ID; their clocks may differ by a second).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, NoReturn, Optional, TypeVar

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_config_search_path, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from loka_trainer.output_dirs import unwritable_reason

# The configs ship inside the package; LOKA_CONF_DIR points at another tree of them (tests use a throwaway one).
CONF_DIR = Path(os.environ.get("LOKA_CONF_DIR", Path(__file__).resolve().parent / "conf"))
T = TypeVar("T")
# job(config without its `hydra` node, resolved; run dir; this job's overrides; its Hydra choices, group -> option)
Job = Callable[[DictConfig, Path, list[str], dict[str, str]], None]
# validate(config, its Hydra choices): raises on a bad config
Validate = Callable[[DictConfig, dict[str, str]], object]
# outputs(config, its run dir; None for a sweep point, numbered only once Hydra starts it): (setting, directory)
# for each directory a run writes to besides its run dir's own files
Outputs = Callable[[DictConfig, Optional[Path]], list[tuple[str, Path]]]
# Hydra flags that show something instead of running: the config is composed but not validated for a run.
SHOW_FLAGS = ("help", "cfg", "info")


def run_name() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id[:8]}"
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


if not OmegaConf.has_resolver("loka_run_name"):
    OmegaConf.register_new_resolver("loka_run_name", run_name, use_cache=True)


# Under torchrun the first rank to exit ends the others: a rank other than 0 waits this long before exiting with
# a failure, so that rank 0, meeting the same error, prints its line first.
OTHER_RANKS_EXIT_AFTER_S = 5.0


def fail(message: object) -> NoReturn:
    """One line on stderr (under torchrun from rank 0 only: every rank meets the same error; the others exit
    ``OTHER_RANKS_EXIT_AFTER_S`` later), exit status 2 (Hydra's search-path listing and append hint are noise for a
    user)."""
    text = str(message).split("Config search path")[0]
    text = " ".join(line for line in text.splitlines() if not line.startswith("To append to your config use"))
    cause = getattr(message, "__cause__", None)
    if cause is not None and str(cause).splitlines():
        text += f" ({str(cause).splitlines()[0]})"
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {' '.join(text.split())}", file=sys.stderr)
    else:
        time.sleep(OTHER_RANKS_EXIT_AFTER_S)
    raise SystemExit(2)


class Composed(NamedTuple):
    """A composed config (without its `hydra` node, resolved), its run dir, and the option Hydra chose in each
    config group (``hydra.runtime.choices``: {"precision": "loka", ...}), which the config itself does not keep."""

    cfg: DictConfig
    run_dir: Path
    choices: dict[str, str]


def compose_config(config_name: str, argv: list[str], *, multirun: bool = False) -> Composed:
    """Compose `conf/<config_name>.yaml` + overrides (``multirun``: the run dir is the sweep dir)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(argv), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        run_dir = Path(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir)
        choices = group_choices(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        OmegaConf.resolve(cfg)
    except Exception as exc:  # Hydra raises several types; all are a bad command line here
        fail(exc)
    return Composed(cfg, run_dir, choices)


def group_choices(choices: DictConfig) -> dict[str, str]:
    """Hydra's ``runtime.choices`` as a plain dict: config group -> chosen option (groups left empty omitted)."""
    return {str(group): str(option) for group, option in choices.items() if option is not None}


def typed_config(cfg: DictConfig, convert: Callable[[DictConfig], T]) -> T:
    """Run `convert` (typed objects + validation); any ValueError/TypeError is a one-line failure."""
    try:
        return convert(cfg)
    except Exception as exc:  # ValueError from validation, OmegaConf errors from conversion
        fail(exc)


def sweep_points(overrides: list[str], config_dir: Optional[str] = None) -> list[list[str]]:
    """The override list of every run of ``-m`` (Hydra's basic sweeper: the cross product of ``a=x,y`` values;
    ``glob(...)`` lists the config groups of conf/ and ``config_dir``)."""
    search = create_config_search_path(str(CONF_DIR))
    if config_dir is not None:
        search.append("command-line", f"file://{os.path.abspath(config_dir)}")
    try:
        loader = ConfigLoaderImpl(config_search_path=search)
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
        return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]
    except Exception as exc:  # grammar errors, unsupported sweep types
        fail(exc)


def parse_hydra_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Hydra's own argument parser (the one ``@hydra.main`` uses); a bad flag is a one-line failure."""
    parser = get_args_parser()
    parser.error = fail  # type: ignore[method-assign]  # argparse would print usage on a second line
    return parser, parser.parse_args(argv)


APP_CONFIGS = {"config": "train.py", "bench": "python -m loka_trainer.bench"}  # conf/<name>.yaml -> its command
EXCLUSIVE_FLAGS = ("run", "multirun", "cfg", "info", "shell_completion")  # Hydra's: one at a time


def unwritable_line(dirs: list[tuple[str, Path]]) -> Optional[str]:
    """'<setting>: cannot write to <dir> (<why>)' for the first of ``dirs`` ((setting, directory) pairs) where no
    file can be created (`output_dirs.unwritable_reason`); None when every one can be written."""
    for setting, path in dirs:
        if (reason := unwritable_reason(path)) is not None:
            return f"{setting}: cannot write to {path} ({reason})"
    return None


def point_label(point: list[str], other: list[str], number: int) -> str:
    """A sweep point named by its overrides that ``other`` lacks; ``#<job number>`` when it has none."""
    own = [override for override in point if override not in other]
    return " ".join(own) if own else f"#{number}"


def shared_dir_line(points: list[tuple[list[str], list[tuple[str, Path]]]]) -> Optional[str]:
    """One line for the first directory two sweep points write to, None when no two share one.

    ``points``: each sweep point (its overrides, in job order) with the (setting, directory) pairs it writes to
    besides its own run dir; directories compare as absolute paths, symlinks resolved. A point's own settings may
    share one directory; two points may not, whichever settings name it."""
    seen: dict[str, tuple[int, str, Path]] = {}  # directory -> (job number, setting, path as given) of its first
    for number, (point, dirs) in enumerate(points):
        for setting, path in dirs:
            first, first_setting, first_path = seen.setdefault(os.path.realpath(path), (number, setting, path))
            if first == number:
                continue
            a = point_label(points[first][0], point, first)
            b = point_label(point, points[first][0], number)
            shared = (f"{setting}={path} is shared by the sweep points {a} and {b}" if setting == first_setting
                      and path == first_path else f"{first_setting}={first_path} of the sweep point {a} is "
                      f"{setting}={path} of the sweep point {b}")
            return (f"{shared}: the second would take over the first's files there (resume from its checkpoints "
                    f"or skip as done, move its Probe stats to previous/); leave it unset (each point's run dir) "
                    f"or sweep it too")
    return None


def preflight(config_name: str, args: argparse.Namespace, validate: Validate,
              outputs: Optional[Outputs] = None) -> None:
    """Compose (and, for a run, validate) every run the command line asks for; fail in one line otherwise.

    A run's directory (the sweep's under ``-m``) and the directories ``outputs`` names for it must be writable, and
    no two sweep points may name one directory (`shared_dir_line`): checked here, before Hydra creates the run
    directory."""
    modes = [flag for flag in EXCLUSIVE_FLAGS if getattr(args, flag)]
    if len(modes) > 1:  # Hydra raises this in a traceback
        fail(f"only one of --run, --multirun, --cfg, --info and --shell-completion can be given, got "
             f"{', '.join('--' + m.replace('_', '-') for m in modes)}")
    if args.hydra_help or args.shell_completion:
        return
    if args.config_path is not None:
        fail("--config-path is not supported: train.py's configs live in conf/; add yours with --config-dir DIR")
    other = APP_CONFIGS.get(args.config_name or config_name)
    if (args.config_name or config_name) != config_name and other is not None:
        fail(f"--config-name {args.config_name} is the config of {other}, not of {APP_CONFIGS[config_name]}; "
             f"a config of yours: --config-dir DIR --config-name NAME")
    search = []
    if args.config_dir is not None:
        if not os.path.isdir(args.config_dir):
            fail(f"--config-dir {args.config_dir!r} is not a directory")
        search = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"]
    showing = any(getattr(args, flag) for flag in SHOW_FLAGS)
    written: list[tuple[list[str], list[tuple[str, Path]]]] = []  # each point's overrides, the dirs it writes
    for point in sweep_points(args.overrides, args.config_dir) if args.multirun else [args.overrides]:
        cfg, out_dir, choices = compose_config(args.config_name or config_name, [*search, *point],
                                               multirun=args.multirun)
        if not showing:
            typed_config(cfg, lambda composed: validate(composed, choices))
            own = outputs(cfg, None if args.multirun else out_dir) if outputs is not None else []
            dirs = [(f"hydra.{'sweep' if args.multirun else 'run'}.dir", out_dir), *own]  # Hydra: a traceback
            if (line := unwritable_line(dirs)) is not None:
                fail(line)
            written.append((point, own))
            if (line := shared_dir_line(written)) is not None:
                fail(line)
    GlobalHydra.instance().clear()


def run_app(config_name: str, argv: list[str], job: Job, *, validate: Validate,
            outputs: Optional[Outputs] = None) -> None:
    """``train.py``'s command line: Hydra's flags and overrides, a pre-flight, then ``job`` once per run.

    ``validate(cfg, choices)`` raises on a bad config (it runs for every sweep point before the first run starts);
    the directories ``outputs(cfg, run_dir)`` names must be writable then too.
    Under ``-m`` the runs follow one another in this process, each in ``<sweep dir>/<job number>``.
    """
    parser, args = parse_hydra_args(argv)
    preflight(config_name, args, validate, outputs)
    rank = int(os.environ.get("RANK", 0))
    extra = [] if rank == 0 else ["hydra/hydra_logging=none"]  # Hydra's sweep lines once, not once per rank
    # A crash inside a run keeps Python's full traceback (Hydra would shorten it and exit 1 all the same).
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")

    def task(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        with open_dict(cfg):
            OmegaConf.resolve(cfg)
        # Relative paths in the config name files from where the command started, as the pre-flight read them;
        # every output goes to the run directory already, so ``hydra.job.chdir=true`` changes nothing else.
        os.chdir(hydra.utils.get_original_cwd())
        job(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task),
            group_choices(hydra_cfg.runtime.choices))

    main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(task)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "train.py", *argv, *extra]
    try:
        main()
    finally:
        sys.argv = saved


def write_run_config(run_dir: Path, cfg: DictConfig, argv: list[str], *, rank: int) -> None:
    """Rank 0 records what ran: `.hydra/config.yaml` and `.hydra/overrides.yaml` like Hydra does."""
    if rank != 0:
        return
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(argv)), hydra_dir / "overrides.yaml")


def parse_argv(argv: Optional[list[str]] = None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
