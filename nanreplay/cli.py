"""The `nanreplay` command. Thin: it parses, calls the library, prints and writes.

Only nanreplay's own errors (NanReplayError) become one line and an exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from nanreplay import interrupt  # first: Ctrl-C stops the command cleanly from here on (interrupt.py)

if __name__ == "__main__" or sys.argv[0].rsplit("/", 1)[-1] in ("nanreplay", "nanreplay.exe"):
    interrupt.install()  # the `nanreplay` command (not a test importing this module): before click, torch, ...

import contextlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from nanreplay import __version__, atomic, inputs, limits, outputs  # noqa: E402
from nanreplay.errors import NanReplayError, OutputError, ReplayError, TimeLimitError, UsageError  # noqa: E402
from nanreplay.sanitize import one_line  # noqa: E402


def _fail(e: NanReplayError) -> None:
    # The message may quote a snapshot (a module name, a path, an error it recorded): escaped, one line.
    click.echo(f"nanreplay: error: {one_line(str(e))}", err=True)
    sys.exit(e.exit_code)


class Size(click.ParamType):
    """`--max-memory 8G`: a size in bytes (binary units)."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return limits.parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


_MAX_MEMORY_HELP = ("Refuse a snapshot whose data or replay would need more memory than SIZE (e.g. 8G, 512M) "
                    "[default: 60% of the memory available now]")


class _Command(click.Group):
    """The `nanreplay` command: called as a program (not through click's test runner), it handles Ctrl-C."""

    def __call__(self, *args, **kwargs):
        interrupt.install()
        return super().__call__(*args, **kwargs)


@click.group(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
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
                   "(output, target); for a snapshot the guard recorded with step_fn, MODULE:CALLABLE names that "
                   "step_fn(model, batch). Without it a scalar model output is the loss.")
@click.option("-o", "--output", "report", metavar="REPORT.html",
              help="Where to write the HTML report ('-' for stdout) [default: ./<snapshot-stem>.nanreplay.html]. "
                   "Only a regular file is ever replaced.")
@click.option("--no-report", is_flag=True, help="Write no HTML report.")
@click.option("--json", "json_path", metavar="PATH|-", help="Also write the analysis as JSON ('-' for stdout).")
@click.option("--markdown", "md_path", metavar="PATH|-",
              help="Also write a short Markdown summary to paste into an issue ('-' for stdout).")
@click.option("-q", "--quiet", is_flag=True,
              help="Print nothing but errors (and what is asked for on stdout: -o -, --json -, --markdown -).")
@click.option("--device", metavar="DEV", help="Device to replay on (cpu, cuda, cuda:1) [default: cpu].")
@click.option("--trust", is_flag=True,
              help="Allow running code the snapshot names or contains (pickled objects, a model factory "
                   "string). Only for snapshots from a source you trust.")
@click.option("--no-verify", is_flag=True, help="Skip replaying the suggested fix (faster).")
@click.option("--source", "source", multiple=True, metavar="DIR", type=click.Path(file_okay=False),
              help="Folder whose .py files may be read to show and rewrite the lines a snapshot recorded (only "
                   "where the file's line matches the recorded code) [default: none: no local file is read, not "
                   "even in the current folder; lines come from the snapshot and paths are shown as recorded]. "
                   "Repeatable.")
@click.option("--timeout", type=click.FloatRange(min=0), default=limits.DEFAULT_TIMEOUT, metavar="SECONDS",
              help="Give up after SECONDS, counted from the start of the command (imports, loading, replays and "
                   "rendering; exit code 1, no output written); a step program whose work cannot fit is refused "
                   "before it runs [default: 600; 0: no limit].")
@click.option("--max-memory", type=Size(), metavar="SIZE", help=_MAX_MEMORY_HELP)
@click.option("--no-confine", is_flag=True,
              help="UNSAFE, for debugging nanreplay on a snapshot you trust: run the analysis in this process "
                   "instead of a confined child (no resource limits, no file or socket filter).")
@click.option("--compile-replay", is_flag=True,
              help="Replay a compiled step (torch.compile) with inductor and the C++ compiler even when the snapshot "
                   "is not small (in a compile child of its own; small ones are replayed compiled anyway).")
@click.option("--nproc", type=click.IntRange(min=1), default=1, metavar="N",
              help="A sharded snapshot folder: replay its ranks on N local processes with torch.distributed.run "
                   "(gloo on the CPU, NCCL with --device cuda), each holding its shard of the weights; N is the "
                   "snapshot's world size [default: 1, every rank replayed on this process].")
def analyze(snapshot: str, model: str | None, loss: str | None, report: str | None, no_report: bool,
            json_path: str | None, md_path: str | None, quiet: bool, device: str | None, trust: bool,
            no_verify: bool, source: tuple[str, ...], timeout: float, max_memory: int | None, no_confine: bool,
            compile_replay: bool, nproc: int) -> None:
    """Replay SNAPSHOT, name the op that broke the step, explain it and suggest a verified fix.

    The analysis runs in a confined child process (docs/trust.md) unless it runs code you name
    (--trust, --model, a --loss MODULE:CALLABLE) or spans ranks (--nproc). On a terminal a status
    line says what runs; the verdict is coloured unless NO_COLOR is set.
    """
    message = (f"nanreplay: error: {one_line(snapshot)}: no result after {timeout:g} s (--timeout counts from the "
               "start of the command); nothing was written")
    try:
        with interrupt.deadline(timeout, message):
            # usage errors first, in a fraction of a second: nothing below needs torch until the analysis
            if no_report and report is not None:
                raise UsageError("-o and --no-report together: say where the report goes, or that none is wanted")
            dests = _analyze_outputs(snapshot, report, json_path, md_path)
            if "://" in snapshot:  # s3://, gs://, file://: a private local copy, size-checked first (remote.py)
                from nanreplay import remote

                snapshot = remote.local_copy(snapshot, max_memory or limits.default_max_memory())
            report_path, json_dest, md_dest = dests
            if no_report:
                report_path = ""  # "": no report at all (None: the report on stdout)
            inputs.snapshot_path(snapshot)
            for option, spec in (("--model", model), ("--loss", loss)):
                if spec and (option == "--model" or ":" in spec):
                    inputs.code_spec(spec, option)
            from nanreplay import confine
            from nanreplay import report as report_mod

            memory = max_memory or limits.default_max_memory()
            limits.set_work_budget(timeout)  # (the confined child sets its own from the job)
            dirs = list(source) if source else None
            to_stdout = report_path is None or (json_path is not None and json_dest is None) or \
                (md_path is not None and md_dest is None)
            live = _Live(err=to_stdout, quiet=quiet)
            live.status("starting")
            try:
                confined = confine.needed(trust=trust, model=model, loss=loss) and nproc == 1 and not no_confine
                if confined:
                    # the child checks --device too; this process never imports torch, it renders the JSON
                    doc = confine.analyze(snapshot, device=device, verify=not no_verify, max_memory=memory, loss=loss,
                                          timeout=timeout, source=dirs, progress=live.progress,
                                          compile_replay=compile_replay, ticker=live.tick)
                else:
                    with live.watching():  # the same status line, from this process's own progress page
                        doc = _analyze_here(snapshot, model=model, loss=loss, device=device, trust=trust,
                                            verify=not no_verify, max_memory=memory, source=dirs, nproc=nproc,
                                            progress=live.progress).to_json()
            finally:
                live.status("")
            try:
                html = report_mod.render_html(doc) if report_path != "" else None  # the renderers read the JSON only
                text = json.dumps(doc, indent=2, allow_nan=False) if json_path else None
                md = report_mod.markdown_summary(doc) if md_path else None
            except (TypeError, KeyError, AttributeError, ValueError, IndexError) as e:
                if not confined:
                    raise
                raise ReplayError(f"{one_line(snapshot)}: the confined analysis sent back a result the report "
                                  f"cannot show ({type(e).__name__}); nothing was written") from None
        with interrupt.deferred():  # all of them or none: Ctrl-C here waits until the last one is written
            outputs = [(report_path, html, "the report")] if report_path else []
            if text is not None and json_dest is not None:
                outputs.append((json_dest, text, "the JSON"))
            if md is not None and md_dest is not None:
                outputs.append((md_dest, md, "the Markdown summary"))
            write_set(outputs)  # a full disk leaves none of them (and says nothing was written)
        if confined and (weaker := confine.weaker(doc)):  # a degraded sandbox is said even with -q
            click.echo(weaker, err=True)
    except interrupt.DeadlineExceeded:  # only in-process (click's test runner): the command stops in interrupt.py
        _fail(TimeLimitError(message.removeprefix("nanreplay: error: ")))
    except NanReplayError as e:
        _fail(e)
    if report_path is None:
        click.echo(html)
    if text is not None and json_dest is None:
        click.echo(text)
    if md is not None and md_dest is None:
        click.echo(md.rstrip("\n"))
    if quiet:
        return
    lines = report_mod.terminal_lines(doc, "(stdout)" if report_path is None else report_path)
    if live.shown and lines[:len(live.shown)] == live.shown:
        lines = lines[len(live.shown):]  # the culprit block is on the terminal already (it cannot have changed)
    elif live.colour:
        lines = report_mod.coloured(lines, doc)
    summary = "\n".join(lines) + _ranks_line(doc.get("distributed"))
    click.echo(summary.lstrip("\n"), err=to_stdout)


class _Live:
    """What the terminal shows while an analysis runs: the culprit block as soon as the replay has it, and on a
    terminal one status line saying which pass is running, from the first second (rewritten in place, cleared at
    the end; the node counter read from the confined child's progress page). Nothing of it on a pipe, nothing at
    all with -q. The JSON and the report are written once, complete, at the end; the rest of the summary follows
    then."""

    NEXT = {"loaded": "replaying the step", "culprit": "diagnosing and verifying the fix",
            "diagnosis": "precision probe", "precision": "finishing"}

    def __init__(self, *, err: bool, quiet: bool = False):
        import os
        import threading

        self._lock = threading.RLock()  # the in-process analysis ticks from a thread (watching)
        self.err, self.quiet = err, quiet
        self.stream = sys.stderr if err else sys.stdout
        self.tty = self.stream.isatty() and not quiet
        self.colour = self.tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
        self.shown: list[str] = []
        self._status = ""
        self._stage = ""

    def status(self, text: str) -> None:
        with self._lock:
            if not self.tty or text == self._status:
                return
            self.stream.write("\r\033[K" + (f"nanreplay: {text}..." if text else ""))
            self.stream.flush()
            self._status = text

    def progress(self, stage: str, result) -> None:
        from nanreplay import report as report_mod

        with self._lock:
            if stage == "culprit" and not self.quiet:
                self.status("")
                self.shown = report_mod.culprit_block(result)
                shown = report_mod.coloured(self.shown, result) if self.colour else self.shown
                if shown:  # (none where the diagnosis decides the verdict)
                    click.echo("\n".join(shown), err=self.err)
            self._stage = self.NEXT.get(stage, "")
            self.status(self._stage)

    @contextlib.contextmanager
    def watching(self):
        """An analysis in this process (--model, --trust, --no-confine): its node loops write the same progress
        page (an anonymous temporary file here), which a thread reads for the status line."""
        if not self.tty:
            yield
            return
        import tempfile
        import threading

        from nanreplay.confine import progress

        stop = threading.Event()
        with tempfile.TemporaryFile() as f:
            f.truncate(progress.SIZE)
            progress.attach(f.fileno())

            def tick():
                while not stop.wait(0.25):
                    self.tick(progress.status(f.fileno()))

            thread = threading.Thread(target=tick, name="nanreplay-status", daemon=True)
            thread.start()
            try:
                yield
            finally:
                stop.set()
                thread.join()
                progress.detach()

    def tick(self, where: tuple[int, int, int] | None) -> None:
        """What the confined child is running now (confine/progress.py's page: numbers only)."""
        from nanreplay.confine import progress

        phase, node, total = where or (0, -1, 0)
        count = f"node {node + 1}/{total}" if node >= 0 and total else ""
        if self._stage:  # after the first replay: the stage, and the node of the replay it is running
            text = self._stage + (f" ({count})" if phase == progress.REPLAY and count else "")
        elif phase == progress.LOAD:
            text = "loading the snapshot"
        elif phase == progress.DRY_RUN:
            text = f"checking the step program (dry run{', ' + count if count else ''})"
        elif phase == progress.REPLAY:
            text = f"replaying the step{' (' + count + ')' if count else ''}"
        elif phase == progress.AFTER:
            text = "replaying the step (backward)"
        else:
            text = "starting (importing torch)"
        self.status(text)


def _analyze_here(snapshot: str, *, device: str | None, **options):
    """The analysis in this process: code the user named runs as the user anyway (or --no-confine)."""
    from nanreplay import analysis as analysis_mod
    from nanreplay.formats.rebuild import parse_device

    parse_device(device)  # a device this machine lacks: one line now, not a traceback later
    return analysis_mod.analyze(snapshot, device=device, **options)


def _analyze_outputs(snapshot: str, report: str | None, json_path: str | None,
                     md_path: str | None) -> tuple[str | None, str | None, str | None]:
    """The report, JSON and Markdown destinations, checked (None: stdout, or not asked for the last two)."""
    report_path = outputs.output_path(report or f"{Path(snapshot).stem}.nanreplay.html", inputs=[snapshot])
    json_dest = outputs.output_path(json_path, inputs=[snapshot], option="--json") if json_path else None
    md_dest = outputs.output_path(md_path, inputs=[snapshot], option="--markdown") if md_path else None
    outputs.distinct(("-o", report_path), *([("--json", json_dest)] if json_path else []),
                     *([("--markdown", md_dest)] if md_path else []))
    return report_path, json_dest, md_dest


def _ranks_line(d: dict | None) -> str:
    """A sharded snapshot: which rank went non-finite first and which ranks got it through a collective."""
    if not d:
        return ""
    first = d.get("first_rank")
    line = f"\n  ranks    {d.get('world_size')} ({d.get('replay', '').replace('_', ' ')}); "
    line += f"first non-finite: rank {first}" if first is not None else "no rank's own step is non-finite"
    if first is not None and d.get("first_reason"):
        line += f" ({one_line(str(d['first_reason']), 160)})"
    reached: dict[tuple, list[str]] = {}
    for g in d.get("collectives") or []:
        if g.get("crossed_to"):
            reached.setdefault((str(g.get("op")), tuple(g["crossed_to"])), []).append(str(g.get("unit")) or "root")
    for (op, ranks), units in reached.items():
        line += (f"\n           reached rank {', '.join(map(str, ranks))} through {one_line(op, 40)} "
                 f"({one_line(', '.join(sorted(units)), 120)})")
    return line


@main.command()
@click.argument("directory", metavar="DIR", required=False)
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
@click.option("--max-memory", type=Size(), metavar="SIZE",
              help="Per snapshot: refuse one whose data or replay would need more memory than SIZE (e.g. 8G) "
                   "[default: 60% of the memory available now, shared among the workers].")
@click.option("--markdown", "md_path", metavar="PATH|-",
              help="Also write a short Markdown summary of the groups to paste into an issue ('-' for stdout).")
@click.option("--shard", "shard_spec", metavar="I/N",
              help="Analyze only part I of N (from 0; by a hash of each file's path) into OUTDIR/parts/; "
                   "then `--merge OUTDIR`. For Slurm arrays, Kubernetes indexed Jobs (docs/fleet.md).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", metavar="[ADDRESS]",
              help="Analyze as tasks on an existing Ray cluster (ray.init(address=ADDRESS); alone: RAY_ADDRESS's, "
                   "else a local one of --jobs CPUs). Needs nanreplay[ray].")
@click.option("--merge", "merge_dir", metavar="OUTDIR",
              help="Join the parts that --shard runs wrote in OUTDIR into its index.html, groups.json and "
                   "summary.csv; name the parts missing (exit 1). Takes no DIR.")
def triage(directory: str | None, outdir: str | None, jobs: int | None, model: str | None, loss: str | None,
           trust: bool, device: str | None, no_verify: bool, recursive: bool, timeout: float, no_cache: bool,
           quiet: bool, max_memory: int | None, md_path: str | None, shard_spec: str | None = None,
           merge_dir: str | None = None, ray_address: str | None = None) -> None:
    """Analyze every snapshot in DIR in parallel and group them by root cause.

    Exit code 0 when every snapshot was analyzed, 1 when any could not be (they are
    listed), 2 for usage errors. Re-running only analyzes new or changed snapshots.
    """
    from nanreplay import triage as triage_mod
    from nanreplay.triage import shard as shard_mod

    plan = None
    shard = None
    try:
        if merge_dir is not None or directory is None:
            result = _merge(directory, merge_dir, shard_spec, md_path)
            sys.exit(result.exit_code or (1 if result.doc["parts"]["missing"] else 0))
        if shard_spec is not None:
            shard = shard_mod.parse_shard(shard_spec)
        if device and device != "cpu":  # torch only when a device must be checked: the parent stays light
            from nanreplay.formats.rebuild import parse_device

            parse_device(device)
        workers = jobs or triage_mod.default_jobs()
        # Each worker analyzes one snapshot at a time: by default they share the machine's memory.
        per_snapshot = max_memory or max(1 << 20, limits.default_max_memory() // workers)
        if "://" in directory:  # s3://, gs://, file://: mirrored into OUTDIR, then triaged (triage/fetch.py)
            from nanreplay.triage import fetch

            outdir = outdir or fetch.default_outdir(directory)
            directory, skipped = fetch.mirror(directory, outdir, max_bytes=per_snapshot, recursive=recursive,
                                              shard=shard)
            for line in skipped:
                click.echo(f"nanreplay: {one_line(line)}", err=True)
        from nanreplay import confine

        if confine.needed(trust=trust, model=model, loss=loss) and (unfiltered := confine.no_file_filter()):
            click.echo(unfiltered, err=True)
        plan = triage_mod.plan(directory, outdir or triage_mod.default_outdir(directory),
                               options=triage_mod.Options(model=model, loss=loss, trust=trust, device=device,
                                                          verify=not no_verify, max_memory=per_snapshot),
                               recursive=recursive, use_cache=not no_cache, shard=shard)
        run = dict(jobs=workers, timeout=timeout or None, **({"ray": ray_address} if ray_address else {}))
        if plan.todo and not quiet and sys.stderr.isatty():
            from nanreplay.triage.parallel import work

            # the ETA from the work done (bytes analyzed), not the count of files: sizes vary by orders of magnitude
            with click.progressbar(length=sum(map(work, plan.todo)), label=f"analyzing {len(plan.todo)} snapshots",
                                   file=sys.stderr) as bar:
                triage_mod.analyze(plan, progress=bar.update, **run)
        else:
            triage_mod.analyze(plan, **run)
        if shard is not None:  # while the part's folder is still locked: write() unlocks it
            shard_mod.write_part(plan, *shard)
        result = triage_mod.write(plan)
        if md_path:
            _emit(md_path, triage_mod.markdown_summary(result.doc), "the Markdown summary", "--markdown")
    except NanReplayError as e:
        _fail(e)
    finally:
        if plan is not None:
            plan.release()
    if not quiet:
        for f in result.failures:  # file names and reasons come from the snapshots: escaped, one line each
            click.echo(f"nanreplay: {one_line(f['file'], 300)}: {f['label']}: {one_line(f['reason'])}", err=True)
    click.echo(f"nanreplay: {result.summary}; index: {one_line(result.index)}", err=md_path == "-")
    sys.exit(result.exit_code)


def _merge(directory: str | None, merge_dir: str | None, shard_spec: str | None, md_path: str | None):
    """`nanreplay triage --merge OUTDIR`: the parts joined, the line said, the parts missing named."""
    from nanreplay.errors import UsageError
    from nanreplay.triage import markdown_summary
    from nanreplay.triage.merge import merge
    from nanreplay.triage.shard import span

    if merge_dir is None:
        raise UsageError("missing DIR (or --merge OUTDIR to join the parts --shard wrote)")
    if directory is not None or shard_spec is not None:
        raise UsageError("--merge OUTDIR takes no DIR and no --shard: it joins the parts already in OUTDIR")
    result = merge(merge_dir)
    if md_path:
        _emit(md_path, markdown_summary(result.doc), "the Markdown summary", "--markdown")
    parts = result.doc["parts"]
    click.echo(f"nanreplay: merged {len(parts['present'])} of {parts['of']} parts: {result.summary}; "
               f"index: {one_line(result.index)}", err=md_path == "-")
    if parts["missing"]:
        click.echo(f"nanreplay: parts missing: {', '.join(map(str, parts['missing']))} of {parts['of']}; run each "
                   f"with --shard I/{parts['of']} (Slurm: --array={span(parts['missing'])}), then merge again",
                   err=True)
    return result


def _emit(path: str, text: str, what: str, option: str) -> None:
    """Write `text` to stdout ('-') or atomically to a checked file."""
    dest = outputs.output_path(path, option=option)
    if dest is None:
        click.echo(text.rstrip("\n"))
    else:
        write_atomic(dest, text, what)


def write_set(outputs: list[tuple[str, str, str]]) -> None:
    """(path, text, what) written all or none (atomic.write_texts); one line naming the one that failed."""
    try:
        atomic.write_texts([(path, text) for path, text, _ in outputs])
    except OSError as e:
        what = next((w for path, _, w in outputs if str(path) == e.filename), "the output")
        rest = "; nothing was written" if len(outputs) > 1 else ""
        raise OutputError(f"{e.filename}: cannot write {what}: {e.strerror or e}{rest}") from None


def write_atomic(path: str, text: str, what: str = "the output") -> None:
    try:
        atomic.write_text(path, text)
    except OSError as e:
        raise OutputError(f"{path}: cannot write {what}: {e.strerror or e}") from None


def _demote_cwd() -> None:
    """`python -m nanreplay.cli` puts the current folder first on sys.path: move it last, so that a file there
    (a planted `jinja2.py`) cannot shadow an installed package. `--model mymodel:build` still finds `mymodel.py`."""
    import os

    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.append(sys.path.pop(0))


if __name__ == "__main__":  # pragma: no cover
    _demote_cwd()
    main()
