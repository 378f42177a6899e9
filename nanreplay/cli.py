"""The `nanreplay` command. Thin: it parses, calls the library, prints and writes.

Only nanreplay's own errors (NanReplayError) become one line and an exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from nanreplay import __version__, atomic
from nanreplay.errors import NanReplayError, UsageError


def _fail(e: NanReplayError) -> None:
    click.echo(f"nanreplay: error: {e}", err=True)
    sys.exit(e.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nanreplay")
def main() -> None:
    """Find the op that made a PyTorch training step NaN or Inf, and how to fix it."""


@main.command()
@click.argument("snapshot")
@click.option("--model", metavar="MODULE:FACTORY",
              help="Zero-argument callable returning the nn.Module whose state is in the snapshot "
                   "(e.g. mypkg.models:build). Needed for plain state-dict snapshots.")
@click.option("--loss", metavar="SPEC",
              help="Loss: a torch.nn.functional name (cross_entropy, mse_loss, ...) or MODULE:CALLABLE taking "
                   "(output, target). Without it a scalar model output is the loss.")
@click.option("-o", "--output", "report", metavar="REPORT.html",
              help="Where to write the HTML report [default: ./<snapshot-stem>.nanreplay.html].")
@click.option("--json", "json_path", metavar="PATH|-", help="Also write the analysis as JSON ('-' for stdout).")
@click.option("--markdown", "md_path", metavar="PATH|-",
              help="Also write a short Markdown summary to paste into an issue ('-' for stdout).")
@click.option("--device", metavar="DEV", help="Device to replay on (cpu, cuda, cuda:1) [default: cpu].")
@click.option("--trust", is_flag=True,
              help="Allow running code the snapshot names or contains (pickled objects, a model factory "
                   "string). Only for snapshots from a source you trust.")
@click.option("--no-verify", is_flag=True, help="Skip replaying the suggested fix (faster).")
def analyze(snapshot: str, model: str | None, loss: str | None, report: str | None, json_path: str | None,
            md_path: str | None, device: str | None, trust: bool, no_verify: bool) -> None:
    """Replay SNAPSHOT, name the op that broke the step, explain it and suggest a verified fix."""
    from nanreplay import analysis as analysis_mod
    from nanreplay import report as report_mod

    try:
        if json_path == "-" and md_path == "-":
            raise UsageError("--json and --markdown cannot both go to stdout ('-'): give one of them a file")
        report_path = _output_path(report or f"{Path(snapshot).stem}.nanreplay.html", snapshot)
        json_dest = _output_path(json_path, snapshot) if json_path and json_path != "-" else json_path
        md_dest = _output_path(md_path, snapshot) if md_path and md_path != "-" else md_path
        result = analysis_mod.analyze(snapshot, model=model, loss=loss, device=device, trust=trust,
                                      verify=not no_verify)
        report_mod.write_report(result, report_path)
        if json_dest:
            _emit(json_dest, json.dumps(result.to_json(), indent=2, allow_nan=False))
        if md_dest:
            _emit(md_dest, report_mod.markdown_summary(result))
    except NanReplayError as e:
        _fail(e)
    summary = report_mod.terminal_summary(result, report_path)
    click.echo(summary, err="-" in (json_dest, md_dest))


@main.command()
@click.argument("directory", metavar="DIR")
@click.option("-o", "--output", "outdir", metavar="OUTDIR",
              help="Folder for index.html, groups.json, summary.csv and one report per snapshot "
                   "[default: ./<DIR name>.nanreplay]. Must not be DIR itself.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), metavar="N",
              help="Worker processes, each analyzing one snapshot at a time [default: the CPU count].")
@click.option("--model", metavar="MODULE:FACTORY",
              help="Model factory for plain state-dict snapshots (as for analyze); only snapshots that need one use it.")
@click.option("--loss", metavar="SPEC", help="Loss spec (as for analyze).")
@click.option("--trust", is_flag=True, help="Allow running code the snapshots name or contain (as for analyze).")
@click.option("--device", metavar="DEV", help="Device to replay on (as for analyze) [default: cpu].")
@click.option("--no-verify", is_flag=True, help="Skip replaying the suggested fixes (faster).")
@click.option("-r", "--recursive", is_flag=True, help="Also look in subfolders (hidden ones and OUTDIR excepted).")
@click.option("--timeout", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="Per-snapshot limit; a replay that runs longer is killed and listed as timed out (0: none).")
@click.option("--no-cache", is_flag=True, help="Re-analyze every snapshot, ignoring results stored in OUTDIR.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no per-failure lines; only the summary.")
@click.option("--markdown", "md_path", metavar="PATH|-",
              help="Also write a short Markdown summary of the groups to paste into an issue ('-' for stdout).")
def triage(directory: str, outdir: str | None, jobs: int | None, model: str | None, loss: str | None, trust: bool,
           device: str | None, no_verify: bool, recursive: bool, timeout: float, no_cache: bool, quiet: bool,
           md_path: str | None) -> None:
    """Analyze every snapshot in DIR in parallel and group them by root cause.

    Exit code 0 when every snapshot was analyzed, 1 when any could not be (they are
    listed), 2 for usage errors. Re-running only analyzes new or changed snapshots.
    """
    from nanreplay import triage as triage_mod

    try:
        plan = triage_mod.plan(directory, outdir or triage_mod.default_outdir(directory),
                               options=triage_mod.Options(model=model, loss=loss, trust=trust, device=device,
                                                          verify=not no_verify),
                               recursive=recursive, use_cache=not no_cache)
        run = dict(jobs=jobs or triage_mod.default_jobs(), timeout=timeout or None)
        if plan.todo and not quiet and sys.stderr.isatty():
            with click.progressbar(length=len(plan.todo), label="analyzing", file=sys.stderr) as bar:
                triage_mod.analyze(plan, progress=bar.update, **run)
        else:
            triage_mod.analyze(plan, **run)
        result = triage_mod.write(plan)
        if md_path:
            _emit(md_path, triage_mod.markdown_summary(result.doc))
    except NanReplayError as e:
        _fail(e)
    if not quiet:
        for f in result.failures:
            click.echo(f"nanreplay: {f['file']}: {f['label']}: {f['reason']}", err=True)
    click.echo(f"nanreplay: {result.summary}; index: {result.index}", err=md_path == "-")
    sys.exit(result.exit_code)


def _output_path(path: str, snapshot: str) -> str:
    """Validate an output path: never the snapshot itself, and its folder must exist."""
    p = Path(path)
    try:
        if p.exists() and Path(snapshot).exists() and p.resolve() == Path(snapshot).resolve():
            raise UsageError(f"{path}: refusing to overwrite the snapshot itself with a report")
    except OSError:
        pass
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{path}: folder {str(parent)!r} does not exist")
    if p.is_dir():
        raise UsageError(f"{path}: is a directory; give a file name")
    return str(p)


def _emit(dest: str, text: str) -> None:
    """Write `text` to stdout ('-') or atomically to a file."""
    if dest == "-":
        click.echo(text.rstrip("\n"))
    else:
        write_atomic(dest, text)


def write_atomic(path: str, text: str) -> None:
    try:
        atomic.write_text(path, text)
    except OSError as e:
        raise UsageError(f"{path}: cannot write: {e.strerror or e}") from None


if __name__ == "__main__":  # pragma: no cover
    main()
