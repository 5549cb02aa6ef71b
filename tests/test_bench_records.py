"""The benchmark records: BENCHMARKS.md is what bench/assemble_benchmarks.py builds from bench/results, within its
length budget, and bench/common.py's writers produce the record format the assembler reads."""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import assemble_benchmarks, common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the page stays readable in one sitting: findings, then one short record per benchmark
MAX_LINES = 260
NARRATION = re.compile(r"session|\bstep \d+|prediction|issue #?\d", re.IGNORECASE)


def test_benchmarks_md_is_assembled_from_the_records():
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        page = f.read()
    assert page == assemble_benchmarks.assemble(), "run: python bench/assemble_benchmarks.py"
    assert page.count("\n") <= MAX_LINES
    assert not NARRATION.search(page), NARRATION.search(page)
    # one page-wide environment line, plus one in each record measured in another environment
    envs = [assemble_benchmarks._environment(open(os.path.join(common.RESULTS, f"{n}.md")).read())
            for n in assemble_benchmarks.ORDER if os.path.exists(os.path.join(common.RESULTS, f"{n}.md"))]
    shared = collections.Counter(e for e in envs if e).most_common(1)[0][0]
    assert page.count("Environment: ") == 1 + sum(e is not None and e != shared for e in envs)


def test_records_name_existing_scripts_and_plots():
    for name in assemble_benchmarks.ORDER:
        path = os.path.join(common.RESULTS, f"{name}.md")
        if not os.path.exists(path):  # a record its benchmark has not written yet
            continue
        with open(path) as f:
            text = f.read()
        script = re.search(r"Reproduce: `[^`]*python (bench/\S+\.py)", text).group(1)
        assert os.path.exists(os.path.join(ROOT, script)), script
        for png in re.findall(r"\]\((bench/results/\S+\.png)\)", text):
            assert os.path.exists(os.path.join(ROOT, png)), png


def test_write_record_format(tmp_path):
    rows = [{"shape": "1x2", "ms": 1.23456, "note": None}]
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"png")
    env = {"gpu": "GPU", "driver": "1", "cuda": "13.0", "torch": "2.0", "triton": "3.0", "cudnn": 9, "date": "d"}
    body = common.markdown_table(rows, ["shape", "ms", "note"], ["shape", "time (ms)", "note"])
    path = common.write_record("x", "Title", "python bench/x.py", body, env, str(plot), str(tmp_path))
    text = open(path).read()
    assert text.startswith("## Title\n\nEnvironment: GPU, driver 1, CUDA 13.0, torch 2.0, triton 3.0, cuDNN 9, d.\n")
    assert "Reproduce: `python bench/x.py`" in text
    assert "| shape | time (ms) | note |\n|---|---:|---|\n| 1x2 | 1.235 | - |" in text
    assert (tmp_path / "x.png").read_bytes() == b"png" and "(bench/results/x.png)" in text


def test_window_bench_parses_its_arguments():
    """The window bench's command line builds (an option declared twice made argparse raise before any timing)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "bench", "attention_window_bench.py"), "--help"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0 and "--window" in done.stdout and "--no-record" in done.stdout, done.stderr[-2000:]


def test_host_time_profile_lists_both_calls_of_rows_outside_their_target(capsys):
    from bench import host_time

    calls = []
    rows = [("slow row", "op", lambda: calls.append("ours"), lambda: calls.append("direct"), None),
            ("fast row", "op", lambda: calls.append("other"), lambda: calls.append("other"), None)]
    results = [{"device": "cpu", "within_target": False, "sdpa_target": None},
               {"device": "cpu", "within_target": True, "sdpa_target": None}]
    host_time.profile(rows, results, 4)
    printed = capsys.readouterr().out
    assert calls == ["ours"] * 4 + ["direct"] * 4  # rows within their target are not profiled
    assert "profile cpu slow row: ours" in printed and "profile cpu slow row: direct" in printed
    assert "fast row" not in printed and "<method 'append' of 'list' objects>" in printed
