"""`smol-pipeline`: the pipeline under accelerate's own launcher, exiting with the pipeline's exit code.

    smol-pipeline [accelerate launch options] recipe=NAME [key=value ...]
    smol-pipeline --config_file zero3 --num_processes 8 recipe=smol

`accelerate launch pipeline/run.py` turns every failure into exit 1 and a launcher traceback (its
simple launcher raises `CalledProcessError`, torch elastic raises `ChildFailedError`). This command
parses the same options with accelerate's `launch_command_parser`, runs `launch_command` on
`pipeline/run.py`, and answers with the code the pipeline itself exited with: 0, 2 bad input, 3 a
gate stop, 4 training failed, 5 memory alert, 75 preempted, 1 a crash (a process killed by signal N: 128 + N),
from the first process that failed. Launch options come first; the first `key=value` argument (or whatever follows `--`)
starts the recipe arguments. `--help` prints the pipeline's usage and the common launch options, `help=true
[recipe=NAME ...]` the recipe's keys, both without launching; a config that does not load (exit 2) stops here
too, before the launcher's own messages.

`--config_file NAME` names a shipped accelerate config (`recipes/accelerate/NAME.yaml`, e.g. zero3)
wherever the package is installed; a path works as with `accelerate launch`. A DeepSpeed JSON that a config names
by a relative path, found beside the config or from the folder holding the package (the shipped configs name theirs
from the checkout's root), goes to accelerate as `--deepspeed_config_file` with its absolute path, unless given, so
a launch works from any directory.

SIGTERM and SIGUSR1 sent to this launcher are passed on to the pipeline processes (which save a
checkpoint and exit 75), and the launcher waits for them: torch elastic is told to leave SIGTERM and SIGINT
alone (`PET_SIGNALS_TO_HANDLE`), as it would otherwise kill the processes after 30 s and lose their codes. A
terminal's Ctrl-C (SIGINT) is passed on as SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.errors import NAMES, ConfigError
from pipeline.recipe_files import RECIPES_DIR

RUN_SCRIPT = Path(__file__).resolve().with_name("run.py")
ACCELERATE_CONFIGS = RECIPES_DIR / "accelerate"
RECIPE_ARG = re.compile(r"^[A-Za-z_][\w.\-]*=")
USAGE = "smol-pipeline [accelerate launch options] [--] recipe=NAME [key=value ...]"
# the launcher options `--help` shows (accelerate's own help text); `accelerate launch --help` lists them all
COMMON_OPTIONS = ("--config_file", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                  "--main_process_port", "--gpu_ids")


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split a command line into accelerate launch options and the pipeline's recipe arguments."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if RECIPE_ARG.match(arg):
            return argv[:i], argv[i:]
    return argv, []


def shipped_configs() -> list[str]:
    """Names of the accelerate configs the package ships (`recipes/accelerate/NAME.yaml`)."""
    return sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The accelerate config file `--config_file` names: a file, else a shipped config's name (`zero3`)."""
    if Path(name).is_file():
        return Path(name)
    if name in shipped_configs():
        return ACCELERATE_CONFIGS / f"{name}.yaml"
    raise ConfigError(f"--config_file '{name}' is neither a file nor a shipped accelerate config "
                      f"({', '.join(shipped_configs())})")


def config_options(name: str, deepspeed_file: str | None) -> list[str]:
    """Launch options that make accelerate config `name` work from any directory: `--config_file` with its path,
    and `--deepspeed_config_file` with the absolute path of the DeepSpeed JSON the config names by a relative path
    (unless `deepspeed_file` was given), found beside the config or else from the folder holding the shipped
    `recipes/` (the shipped configs name theirs from the checkout's root, where plain `accelerate launch` finds them
    too); a JSON found in neither is left to accelerate, which reads it from the working directory."""
    import yaml

    path = config_path(name)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"--config_file {path} does not read as an accelerate config: {err}") from err
    deepspeed = config.get("deepspeed_config") if isinstance(config, dict) else None
    named = deepspeed.get("deepspeed_config_file") if isinstance(deepspeed, dict) else None
    found = [p for p in (path.parent / str(named), RECIPES_DIR.parent / str(named)) if named and p.is_file()]
    if deepspeed_file is None and found:
        return ["--config_file", str(path), "--deepspeed_config_file", str(found[0].resolve())]
    return ["--config_file", str(path)]


def shell_code(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def forward_signals() -> None:
    """Pass SIGTERM / SIGUSR1 on to this process's children (the pipeline processes) and keep waiting; SIGINT (a
    terminal's Ctrl-C) goes on as SIGTERM: torch elastic starts its processes in sessions of their own, which the
    terminal does not reach, while a single process in the launcher's group gets the terminal's SIGINT as well
    (a second SIGINT would stop it at once)."""
    import psutil

    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGHUP,SIGQUIT")  # torch elastic: SIGTERM and SIGINT are ours

    def forward(signum: int, _frame: object) -> None:
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)


def one_process(args: object) -> None:
    """accelerate's simple launcher (one process), waiting for the process through SIGTERM / SIGUSR1: its own
    exits 143 on SIGTERM and kills the process 5 s later, before a checkpoint is saved and its code is known."""
    from accelerate.utils import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    code = subprocess.Popen(cmd, env=env).wait()
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def log_hint(recipe: list[str]) -> str:
    """`; log: <run>/pipeline.log` for the run these recipe arguments name, when that log exists."""
    from pipeline.config import load_config
    from pipeline.runfolder import RunPaths

    try:
        cfg = load_config(recipe)
    except ConfigError:
        return ""
    path = RunPaths.of(cfg).log
    return f"; log: {path}" if path.is_file() else ""


def launcher_help(parser: object) -> str:
    """The common launcher options of accelerate's `parser`, one line each, and where the rest are."""
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    text = {name: (actions[name].help or "").split(". ")[0].rstrip(".") for name in COMMON_OPTIONS}
    text["--config_file"] += f", or a shipped config's name: {', '.join(shipped_configs())}"
    lines = [f"  {name:<21} {text[name]}" for name in COMMON_OPTIONS]
    return "\n".join(["Launcher options (accelerate launch; all of them: accelerate launch --help):", *lines])


def main(argv: list[str] | None = None) -> int:
    """Launch `pipeline/run.py` through accelerate's launcher; return the pipeline's own exit code. `--help` and
    `help=true` are answered here, without a launch."""
    from pipeline import run

    options, recipe = split_args(sys.argv[1:] if argv is None else argv)
    if any(arg.partition("=")[0] == "help" for arg in recipe):
        return run.main(recipe)
    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = launch_command_parser()
    if {"-h", "--help"} & {*options, *recipe}:
        print(f"{run.usage()}\n\n{launcher_help(parser)}")
        return 0
    if bad := run.config_error(recipe):  # before the launcher's own messages and its processes
        return bad
    parser.prog, parser.usage = "smol-pipeline", USAGE
    args = parser.parse_args([*options, str(RUN_SCRIPT), *recipe])
    if args.config_file:
        try:
            options = [*options, *config_options(args.config_file, args.deepspeed_config_file)]
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return err.code
        args = parser.parse_args([*options, str(RUN_SCRIPT), *recipe])  # the later --config_file wins
    args.quiet = False  # --quiet makes the launchers exit 1 instead of raising the child's code
    forward_signals()
    accelerate_launch.simple_launcher = one_process
    accelerate_launch.logger.setLevel(logging.ERROR)  # not its list of options left at their defaults
    try:
        launch_command(args)
    except subprocess.CalledProcessError as err:
        return shell_code(err.returncode)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = shell_code(failure.exitcode)
        print(f"smol-pipeline: exit {code} ({NAMES.get(code, 'crashed')}) from rank {rank}{log_hint(recipe)}",
              file=sys.stderr)  # torch elastic's log lines come after the processes' last words
        return code
    except SignalException as err:  # SIGHUP / SIGQUIT: torch elastic stopped the processes
        return 128 + err.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
