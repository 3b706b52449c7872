"""The resuming process of ``test_resume.py``: a fresh Python process that has never seen the run.

Usage: ``python _resume_worker.py JOBS OUT``. ``JOBS`` is a ``torch.save``'d list of jobs (dicts
with a ``kind`` and an ``id``) naming checkpoint files written by the test; each job is run by
``test_resume.resume_<kind>(job)`` and the results are saved to ``OUT`` as ``{id: result}``; a job
that raises has its traceback as its result (the test of that case fails with it, the others run).
"""

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_resume as t  # noqa: E402


def main(jobs_path: str, out_path: str) -> None:
    torch.set_num_threads(1)  # as the test process: the same reductions, the same rounding
    results = {}
    for job in torch.load(jobs_path):
        try:
            results[job["id"]] = getattr(t, f"resume_{job['kind']}")(job)
        except Exception:
            results[job["id"]] = traceback.format_exc()
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
