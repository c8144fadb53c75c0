"""The command line: parse, call one stage function, turn known errors into exit codes.

Each command is a few lines; the work lives in `gsm8kctl/stages/`. Trailing `key=value`
arguments are config overrides (`+key=value` too), exactly like the original command line.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from gsm8kctl.artifacts.jsonl import STDOUT_NAME, WRITE_ERRNOS, naming
from gsm8kctl.config import load_config
from gsm8kctl.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, StageFailed, Stopped, UserError
from gsm8kctl.progress import error_line

app = typer.Typer(
    help="Rejection sampling and REINFORCE-style RL for GSM8k. Every stage reads and writes files; "
         "'-' means stdin/stdout JSONL. Trailing key=value arguments override the config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ---------------------------------------------------------------------------- shared options
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file (see configs/).")]
ModelOpt = Annotated[Optional[str], typer.Option(help="Hub id, local HF directory, or smollm2-135m (embedded).")]
BackendOpt = Annotated[Optional[str], typer.Option(help="auto | transformers | vllm | openai.")]
BaseUrlOpt = Annotated[Optional[str], typer.Option(help="Backend openai: server URL(s), comma-separated, "
                                                        "e.g. http://127.0.0.1:8000/v1.")]
DataDirOpt = Annotated[Optional[Path], typer.Option(help="Directory with GSM8k train.jsonl/test.jsonl "
                                                         "(default: $GSM8K_DIR, else the hub).")]
CallsOpt = Annotated[Optional[str], typer.Option("--llm-calls", help="LLM call log (sqlite); default: "
                                                                      "llm_calls.sqlite next to the output.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or tables on stderr.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show what the libraries print (logs, warnings, "
                                                                  "progress bars) here too; without it, it goes to "
                                                                  "output.log beside the output only.")]
Overrides = Annotated[Optional[list[str]], typer.Argument(help="Config overrides key.sub=value.",
                                                          show_default=False)]


# OSError numbers that mean "this path cannot be used as given", not a fault of the program.
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EROFS,
                errno.ENAMETOOLONG, errno.ELOOP}


def _is_path_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.filename is not None and exc.errno in _PATH_ERRNOS


def _is_write_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.filename is not None and exc.errno in WRITE_ERRNOS


def _print_json(obj) -> None:
    with naming(STDOUT_NAME):
        typer.echo(json.dumps(obj, allow_nan=False))


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is buffered cannot fail
    again at exit (Python then exits 120 with an `Exception ignored` message)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _handle_errors(fn):
    """One place maps exceptions to exit codes; GSM8KCTL_DEBUG=1 re-raises for a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            if os.environ.get("GSM8KCTL_DEBUG"):
                raise
            error_line(f"Error: {exc}")
            raise typer.Exit(EXIT_BAD_INPUT)
        except (StageFailed, Stopped) as exc:
            if os.environ.get("GSM8KCTL_DEBUG"):
                raise
            error_line(f"Error: {exc}")
            raise typer.Exit(EXIT_INTERNAL)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except BrokenPipeError:
            # `gsm8kctl ... | head` closed the pipe: not an error of ours.
            _discard_stdout()
            raise typer.Exit(0)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if os.environ.get("GSM8KCTL_DEBUG"):
                raise
            if _is_write_error(exc):  # a full disk: not the user's input, not our bug either
                if exc.filename == STDOUT_NAME:
                    _discard_stdout()
                error_line(f"Error: {exc.filename}: {exc.strerror}")
                raise typer.Exit(EXIT_INTERNAL)
            from gsm8kctl import oom

            if oom.is_oom(exc):  # a shared GPU filled up: expected, not a bug (gsm8kctl/oom.py)
                error_line(f"Error: {oom.describe(fn.__name__.rstrip('_').replace('_', '-'))}")
                raise typer.Exit(EXIT_INTERNAL)
            if _is_path_error(exc):  # a path the stages' checks did not foresee: still the user's input
                error_line(f"Error: {exc.filename}: {exc.strerror}")
                raise typer.Exit(EXIT_BAD_INPUT)
            error_line(f"Internal error: {type(exc).__name__}: {exc} (GSM8KCTL_DEBUG=1 shows the traceback)")
            raise typer.Exit(EXIT_INTERNAL)

    return wrapper


def _libraries_logged(out_dir: Optional[Path], verbose: bool):
    """What libraries print during a stage goes to OUT_DIR/output.log (progress.library_output_kept)."""
    from gsm8kctl.artifacts.rundir import OUTPUT_LOG_FILE
    from gsm8kctl.progress import library_output_kept

    return library_output_kept(None if verbose or out_dir is None else out_dir / OUTPUT_LOG_FILE)


def _problem_ids(text: Optional[str], count: Optional[int], count_option: str) -> Optional[list[str]]:
    """--problem-ids as a list; one that names no id is refused, not read as "all problems"."""
    if text is None:
        return None
    ids = [p.strip() for p in text.split(",") if p.strip()]
    if not ids:
        raise UserError(f"--problem-ids: no problem id in {text!r}; give ids like train-00042,train-00007")
    if count is not None:
        raise UserError(f"--problem-ids and {count_option}: give one of them, not both")
    return ids


def _config(config: Optional[Path], overrides: Optional[list[str]], command: Optional[str] = None,
            **typed) -> dict:
    """Defaults < --config file < key=value overrides < typed options given on the command line.

    Checked once against the schema, options included, before the command does any work;
    `command` adds the rules only it needs (the loop's max_agent_forks >= attempts).
    """
    return load_config(config, overrides or [], options=typed, command=command)


def _split_paths(args: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """Positional arguments: `key=value` are overrides unless a file of that name exists."""
    paths, overrides = [], []
    for a in args or []:
        (overrides if "=" in a and not Path(a).exists() else paths).append(a)
    return paths, overrides


# ---------------------------------------------------------------------------- commands
@app.command()
@_handle_errors
def sample(
    out: Annotated[str, typer.Option("--out", "-o", help="Tapes JSONL to append to, or - for stdout.")],
    model: ModelOpt = None,
    backend: BackendOpt = None,
    base_url: BaseUrlOpt = None,
    split: Annotated[str, typer.Option(help="train | validation | test (validation: train problems held out "
                                            "by seed; train: the rest).")] = "train",
    n_problems: Annotated[Optional[int], typer.Option(help="The first N problems of the split.")] = None,
    problem_ids: Annotated[Optional[str], typer.Option(help="Comma-separated ids, e.g. train-00042.")] = None,
    attempts: Annotated[Optional[int], typer.Option(help="Completions per problem.")] = None,
    temperature: Annotated[Optional[float], typer.Option()] = None,
    top_p: Annotated[Optional[float], typer.Option()] = None,
    max_tokens: Annotated[Optional[int], typer.Option()] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    iteration: Annotated[int, typer.Option(min=-1, help="Iteration number recorded in the tapes (-1: before a warm start).")] = 0,
    llm_calls: CallsOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    overrides: Overrides = None,
):
    """Sample ATTEMPTS completions per problem; append tapes (rerun = resume)."""
    from gsm8kctl.progress import say
    from gsm8kctl.stages.sample import sample as run

    cfg = _config(config, overrides, model=model, backend=backend, attempts=attempts,
                  **{"openai.base_url": base_url, "sampling.temperature": temperature, "sampling.top_p": top_p,
                     "sampling.max_tokens": max_tokens, "seed": seed,
                     "data_dir": str(data_dir) if data_dir else None})
    ids = _problem_ids(problem_ids, n_problems, "--n-problems")
    with _libraries_logged(None if out == "-" else Path(out).parent, verbose):
        result = run(cfg, out=out, split=split, n_problems=n_problems, problem_ids=ids, calls_db=llm_calls,
                     iteration=iteration, quiet=quiet)
    say(f"{result['tapes']} tapes written ({result['skipped']} already there), {result['tokens_per_s']:.0f} tok/s",
        quiet)


@app.command()
@_handle_errors
def evaluate(
    out: Annotated[str, typer.Option("--out", "-o", help="Output directory (tapes.jsonl, metrics.json).")],
    model: ModelOpt = None,
    backend: BackendOpt = None,
    base_url: BaseUrlOpt = None,
    split: Annotated[str, typer.Option(help="test | validation (train problems held out by seed, "
                                            "validation_problems of them) | train.")] = "test",
    limit: Annotated[Optional[int], typer.Option(help="First K problems of the split (default: eval_limit; "
                                                      "null = all).")] = None,
    problem_ids: Annotated[Optional[str], typer.Option(help="Comma-separated ids instead, e.g. test-00042.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option()] = None,
    iteration: Annotated[int, typer.Option(min=-1, help="Iteration number recorded in the tapes (-1: before a warm start).")] = 0,
    llm_calls: CallsOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    overrides: Overrides = None,
):
    """Greedy accuracy on a split (default test), strict (\\boxed{}) and lenient side by side."""
    from gsm8kctl.stages.evaluate import evaluate as run
    from gsm8kctl.stages.stats import render_table

    cfg = _config(config, overrides, model=model, backend=backend,
                  **{"openai.base_url": base_url, "evaluation.max_tokens": max_tokens, "data_dir": str(data_dir) if data_dir else None})
    ids = _problem_ids(problem_ids, limit, "--limit")
    if limit is None and split == "test":
        limit = cfg["eval_limit"]  # eval_limit is the loop's test budget; a validation split is small already
    with _libraries_logged(Path(out), verbose):
        metrics = run(cfg, out_dir=out, limit=limit, split=split,
                      calls_db=llm_calls, iteration=iteration, quiet=quiet, problem_ids=ids)
    if json_out:
        _print_json(metrics)
    elif not quiet:
        render_table(metrics, f"evaluate {out}")


@app.command()
@_handle_errors
def stats(
    path: Annotated[str, typer.Argument(help="Tapes or samples JSONL, or - for stdin.")],
    json_out: JsonOpt = False,
):
    """Counts, token lengths, rewards, strict/lenient accuracy, pass@k of a tapes or samples file."""
    from gsm8kctl.artifacts.jsonl import read_jsonl
    from gsm8kctl.stages.stats import file_stats, render_table

    result = file_stats(read_jsonl(path))
    if result["count"] == 0:
        raise UserError(f"{path}: no records")
    if json_out:
        _print_json(result)
    else:
        render_table(result, f"stats {path}")


@app.command(name="filter")
@_handle_errors
def filter_(
    tapes: Annotated[Optional[list[str]], typer.Argument(help="Tapes JSONL files or - (stdin); then key=value "
                                                              "overrides.", show_default=False)] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="Samples JSONL, or - for stdout.")] = "-",
    mode: Annotated[Optional[str], typer.Option(help="rejection (reward > 0 only) | all (weighted); "
                                                     "default from use_rejection_sampling.")] = None,
    max_per_problem: Annotated[Optional[int], typer.Option(help="Rejection mode: keep at most K per problem.")] = None,
    drop_uniform_groups: Annotated[Optional[bool], typer.Option("--drop-uniform-groups/--keep-uniform-groups",
                                                                help="Drop groups whose rewards are all equal.")] = None,
    ref_model: Annotated[Optional[str], typer.Option(help="Reference model for ref_logprobs / KL.")] = None,
    ref_backend: Annotated[Optional[str], typer.Option(help="Backend that scores with the reference.")] = None,
    gold: Annotated[bool, typer.Option("--gold", help="SFT samples from GSM8k gold solutions instead of tapes.")] = False,
    split: Annotated[str, typer.Option(help="With --gold: train | validation | test (train never holds a "
                                            "validation problem).")] = "train",
    n_problems: Annotated[Optional[int], typer.Option(help="With --gold: the first N problems.")] = None,
    model: ModelOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Turn tapes into training samples: rejection sampling, or all with advantages (+ KL)."""
    from gsm8kctl.stages.filter import run_filter

    paths, overrides = _split_paths(tapes)
    cfg = _config(config, overrides, model=model, data_dir=str(data_dir) if data_dir else None)
    with _libraries_logged(None if out == "-" else Path(out).parent, verbose):
        run_filter(paths, out, cfg, mode=mode, max_per_problem=max_per_problem,
                   drop_uniform_groups=drop_uniform_groups, ref_model=ref_model, ref_backend=ref_backend,
                   gold=gold, split=split, model=model, n_problems=n_problems,
                   data_dir=str(data_dir) if data_dir else None, quiet=quiet)


@app.command()
@_handle_errors
def finetune(
    samples: Annotated[list[str], typer.Argument(help="Samples JSONL files (from filter) or -; then key=value "
                                                      "overrides.", show_default=False)],
    out: Annotated[str, typer.Option("--out", "-o", help="Run directory: checkpoints/, finetune/metrics.jsonl.")],
    init: Annotated[Optional[str], typer.Option(help="Start weights when OUT has no checkpoint yet.")] = None,
    objective: Annotated[Optional[str], typer.Option(help="sft | reinforce | grpo (default from config).")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps on these samples (default: epochs).")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Cap on the global optimizer step.")] = None,
    num_processes: Annotated[Optional[int], typer.Option(help=">1: accelerate launch with N processes.")] = None,
    model: ModelOpt = None,
    config: ConfigOpt = None,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
):
    """Train the latest checkpoint (or --init) on samples; resumable, multi-process with accelerate."""
    from gsm8kctl.progress import say
    from gsm8kctl.stages.finetune import describe_result, run_finetune

    paths, overrides = _split_paths(samples)
    if not paths:
        raise UserError("no samples files given")
    cfg = _config(config, overrides, model=model)
    with _libraries_logged(Path(out), verbose):
        summary = run_finetune(paths, out, cfg, init=init, objective=objective, num_processes=num_processes,
                               steps=steps, max_steps=max_steps, quiet=quiet)
    if json_out:
        _print_json(summary)
    elif not quiet and summary and describe_result(summary):
        say(describe_result(summary), verbatim=True)


@app.command(context_settings={"allow_extra_args": False})
@_handle_errors
def loop(
    overrides: Overrides = None,
    run_dir: Annotated[Path, typer.Option(help="Run directory (created; rerun the same command to resume).")] =
    Path("runs/default"),
    attempts: Annotated[Optional[int], typer.Option(help="Completions per training problem.")] = None,
    iterations: Annotated[Optional[int], typer.Option(help="RL iterations.")] = None,
    model: ModelOpt = None,
    backend: BackendOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
    quiet: QuietOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show what the libraries print (logs, "
                                                                  "warnings, progress bars) here too; without "
                                                                  "it, it goes to RUN/output.log only.")] = False,
):
    """The RL loop: evaluate, sample, filter, finetune, record; crash-safe resume."""
    from gsm8kctl.loop.driver import loop as run

    sizes: dict = {}
    cfg = load_config(config, overrides or [], command="loop", sizes_chosen=sizes,
                      options=dict(attempts=attempts, iterations=iterations, model=model, backend=backend,
                                   data_dir=str(data_dir) if data_dir else None))
    run(cfg, str(run_dir), quiet=quiet, sizes=sizes,
        library_log=not (verbose or os.environ.get("GSM8KCTL_DEBUG")))


@app.command()
@_handle_errors
def control(
    like: Annotated[Path, typer.Argument(help="The RL run directory (a loop's --run-dir) to match.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The control's directory (created; rerun to resume).")],
    at: Annotated[str, typer.Option(help="Match the RL run's best checkpoint (chosen on validation), its last "
                                         "evaluation, or all of its evaluations: best | last | all.")] = "best",
    overrides: Overrides = None,
    quiet: QuietOpt = False,
):
    """The SFT-only control of an RL run: gold solutions for as many tokens as it trained."""
    from gsm8kctl.loop.control import check_rl_run
    from gsm8kctl.loop.control import control as run
    from gsm8kctl.progress import say

    check_rl_run(like)
    cfg = load_config(like / "config.yaml", overrides or [])  # the RL run's own config
    rows = run(cfg, str(like), str(out), at=at, quiet=quiet)
    if not quiet:
        say(json.dumps(rows[-1], allow_nan=False) if rows else "nothing to match yet", verbatim=True)


@app.command()
@_handle_errors
def seeds(
    overrides: Overrides = None,
    run_dir: Annotated[Path, typer.Option(help="Where the seeds' runs and seeds.json go (rerun to resume).")] =
    Path("runs/seeds"),
    seed_list: Annotated[str, typer.Option("--seeds", help="Comma-separated seeds, one loop each.")] = "1,2,3",
    parallel: Annotated[Optional[int], typer.Option(help="Loops at once (default: all on a GPU, 1 on a CPU).")] = None,
    with_control: Annotated[bool, typer.Option("--control/--no-control", help="Run each seed's SFT-only control "
                                                                              "at equal tokens.")] = True,
    config: ConfigOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
):
    """One recipe over several seeds: each a loop and its SFT control; medians and ranges."""
    from gsm8kctl.loop.seeds import seeds as run

    try:
        chosen = [int(s) for s in seed_list.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds: expected comma-separated integers, got {seed_list!r}") from None
    cfg = load_config(config, overrides or [], command="loop")  # checked once, before any loop starts
    for s in chosen:
        load_config(config, [*(overrides or []), f"seed={s}"], command="loop")
    summary = run(cfg, str(run_dir), seed_list=chosen, config=str(config) if config else None,
                  overrides=[*(overrides or []), f"machine={cfg['machine']}"], parallel=parallel,
                  with_control=with_control, quiet=quiet or json_out)
    if json_out:
        _print_json(summary)


@app.command(name="gather-tapes")
@_handle_errors
def gather_tapes(
    sources: Annotated[list[str], typer.Argument(help="Files and directories (searched recursively): this "
                       "project's JSONL / JSON-list tapes, TapeAgents JSON/JSONL/YAML tapes; - reads stdin.",
                       show_default=False)],
    out: Annotated[str, typer.Option("--out", "-o", help="Output JSONL (written atomically), or - for stdout.")],
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
):
    """Collect tapes from files and directories into one JSONL file, deduplicated by tape id."""
    from gsm8kctl.stages.gather_tapes import gather_tapes as run

    if json_out and out == "-":
        raise UserError("--json prints to stdout; give -o FILE for the tapes")
    result = run(sources, out, quiet=quiet or json_out)
    if json_out:
        _print_json(result)


@app.command()
@_handle_errors
def browse(
    path: Annotated[Path, typer.Argument(help="A tapes JSONL file, a gather-tapes file, or a run directory.")],
    host: Annotated[str, typer.Option(help="Interface to bind; anything but 127.0.0.1/localhost is reachable "
                                           "by others (a warning is printed).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 = any free port).")] = 7680,
    llm_calls: Annotated[Optional[Path], typer.Option("--llm-calls", help="LLM call log (sqlite); default: the "
                         "nearest llm_calls.sqlite beside PATH, up to its run directory.")] = None,
    open_browser: Annotated[bool, typer.Option("--open", help="Open the page in the default web browser.")] = False,
    tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer directory or tokenizer.json for per-token "
                         "logprob shading (default: found from each tape's model).")] = None,
    quiet: QuietOpt = False,
):
    """Browse tapes and LLM calls in a local, read-only web page."""
    from gsm8kctl.stages.browse import browse as run

    run(str(path), host=host, port=port, llm_calls=str(llm_calls) if llm_calls else None,
        open_browser=open_browser, tokenizer=str(tokenizer) if tokenizer else None, quiet=quiet)


def _click_exceptions():
    """The click exception classes typer raises (typer >= 0.20 vendors click as typer._click)."""
    return sys.modules[typer.BadParameter.__module__]


def _usage_error_line(exc) -> str:
    """A click usage error as one line (`--attempts: 'abc' is not a valid integer`), not a 5-line box."""
    if isinstance(exc, typer.BadParameter) and exc.param is not None and exc.message:
        p = exc.param
        name = max(p.opts, key=len) if getattr(p, "opts", None) and p.param_type_name == "option" \
            else p.human_readable_name
        cause = exc.__cause__
        errors = getattr(cause, "errors", None)
        if callable(errors):  # typer converts with pydantic: the first error holds the raw input
            first = errors()[0]
            kind = str(first.get("type", ""))
            value = first.get("input")
            for prefix, what in (("int_", "a valid integer"), ("float_", "a valid number"),
                                 ("bool_", "true or false")):
                if kind.startswith(prefix):
                    return f"{name}: {value!r} is not {what}"
            return f"{name}: {value!r}: {str(first.get('msg', exc.message)).rstrip('.')}"
        return f"{name}: {exc.message.rstrip('.')}"
    text = " ".join(exc.format_message().split())
    return f"{text.rstrip('.')} (see --help)"


def main() -> None:
    """Run the app; a usage error (bad option, bad typed value) is one `Error:` line and exit 2."""
    from gsm8kctl.progress import keep_stdout_for_data, talk_from_parent

    keep_stdout_for_data()
    talk_from_parent()
    errors = _click_exceptions()
    try:
        rv = app(standalone_mode=False)
    except errors.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help())
        sys.exit(EXIT_BAD_INPUT)
    except errors.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter...
        if os.environ.get("GSM8KCTL_DEBUG"):
            raise
        error_line(f"Error: {_usage_error_line(exc)}")
        sys.exit(EXIT_BAD_INPUT)
    except errors.ClickException as exc:
        error_line(f"Error: {' '.join(exc.format_message().split())}")
        sys.exit(exc.exit_code)
    except typer.Abort:
        error_line("Aborted.")
        sys.exit(EXIT_INTERNAL)
    # Without standalone mode click returns the exit code of a typer.Exit, or the command's value.
    code = rv if isinstance(rv, int) else 0
    try:  # what is still buffered, flushed here where its errors get one line, not at exit
        with naming(STDOUT_NAME):
            sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
    except OSError as exc:
        _discard_stdout()
        error_line(f"Error: {exc.filename or STDOUT_NAME}: {exc.strerror}")
        code = code or EXIT_INTERNAL
    sys.exit(code)


if __name__ == "__main__":
    main()
