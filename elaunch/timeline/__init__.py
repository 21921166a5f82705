"""``elaunch timeline LOGDIR... -o FILE``: draw agents' event logs as one picture.

Each LOGDIR is searched recursively for ``events.jsonl`` (each agent writes one
in its run's log directory, docs/events.md); the picture has one lane per node:
rounds as spans, the time spent in rendezvous, each worker's lifetime, and marks
for failures, restarts, membership changes, hangs, notices and the job's end
(docs/timeline.md). ``-o`` ending in ``.svg`` or ``.html`` writes a
self-contained file without any extra package; ``.png`` needs matplotlib
(``pip install 'elaunch[bench]'``). No torchrun counterpart.

Exit status: 0 written; 2 bad input (one line naming it: a missing path, no
event file, an unknown output type, an output that cannot be written, e.g. in a
directory that does not exist); 1 when matplotlib is missing for a PNG. Lines
that are not an event (not JSON, no ``time`` or ``kind``, a field of the wrong
type) are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys

from .model import Timeline, TimelineError, build, find_event_files, read_events

FORMATS = (".svg", ".html", ".png")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the whole usage)
        raise TimelineError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elaunch timeline", description="Draw agents' events.jsonl files as one timeline.")
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR",
                   help="a log directory (searched recursively for events.jsonl) or an events.jsonl file")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the picture to write: .svg, .html (self-contained) or .png (needs matplotlib)")
    p.add_argument("--title", default=None, help="the picture's title [default: nodes and duration]")
    return p


def load(paths: list[str]) -> Timeline:
    """The timeline of every ``events.jsonl`` under ``paths``.

    Raises:
        TimelineError: a path does not exist, or holds no events (a ValueError).
    """
    return build(read_events(find_event_files(paths)))


def write(tl: Timeline, output: str, title: str | None = None) -> None:
    """Draw ``tl`` into ``output`` (its extension picks the format, see :data:`FORMATS`).

    Raises:
        TimelineError: an extension not in :data:`FORMATS`.
        ImportError: matplotlib is missing for a PNG.
        OSError: the file cannot be written.
    """
    ext = os.path.splitext(output)[1].lower()
    if ext not in FORMATS:
        raise TimelineError(f"-o {output}: unknown picture type {ext or '(none)'!r} (use .svg, .html or .png)")
    if ext == ".png":
        from .png import render_png

        render_png(tl, output, title)
        return
    from .svg import render_html, render_svg

    text = render_svg(tl, title) if ext == ".svg" else render_html(tl, title)
    with open(output, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    """Run ``elaunch timeline`` with ``argv`` (without the program and subcommand names); return the exit status.

    Returns:
        0 written; 2 bad input or an output that cannot be written (one line on stderr);
        1 matplotlib missing for a PNG. Never raises for bad input.
    """
    if argv is not None and any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    try:
        args = _parser().parse_args(argv)
        tl = load(args.logdirs)
        write(tl, args.output, args.title)
    except TimelineError as exc:
        print(f"elaunch timeline: error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print("elaunch timeline: a .png needs matplotlib: pip install 'elaunch[bench]' (or matplotlib), "
              "or write .svg or .html", file=sys.stderr)
        return 1
    except OSError as exc:  # the output's path (reading is a TimelineError): its directory is missing, ...
        print(f"elaunch timeline: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(tl.lanes)} node(s), {tl.end:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
