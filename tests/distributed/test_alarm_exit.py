"""Issue 33, "every rank exits 18": the README's job under torchrun with an update fault and
policy ``raise``, on 2 and 4 ranks. Every rank raises at the same step, and torchrun's agent
SIGTERMs the other ranks as soon as the first exits non-zero; before, a rank still closing its
trace or tearing down was killed (-15) and only the first said 18 (one launch in three on 2 ranks).

To make that race certain rather than likely, every rank but the last takes three seconds to end
after the alarm, as a job whose teardown flushes loggers or joins data workers does: the last
rank exits first and the agent SIGTERMs the others while they wait. Each must still exit 18, and
torchrun's failure report must list every rank with exit code 18. (The wrapper ends each process
with ``os._exit`` after that wait, as ``tests/recorder/test_readme_job.py`` does, to keep torch's
own gloo teardown race out of the test.)
"""

from __future__ import annotations

import pytest

from sdc_forensics.recorder import ALARM_EXIT_CODE
from tests.distributed.launch import torchrun
from tests.distributed.test_torchrun_cli import _process_exit_codes
from tests.recorder.test_readme_job import readme_job

pytestmark = pytest.mark.slow

TIMEOUT_S = 240
RECORDER = 'Recorder("runs/job42/trace", ddp_model, optimizer, recipe="mytrain:Recipe", recipe_args=settings,'
SLOW_END = (
    "import os, runpy, sys, time\n"
    "code = 0\n"
    "try:\n"
    "    runpy.run_path('mytrain.py', run_name='__main__')\n"
    "except SystemExit as stop:\n"
    "    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)\n"
    "if int(os.environ['RANK']) != int(os.environ['WORLD_SIZE']) - 1:\n"
    "    time.sleep(3)  # a slow teardown: the last rank is out first, and the agent SIGTERMs this one meanwhile\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os._exit(code)\n"
)


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_rank_exits_18_under_torchrun(tmp_path, nproc):
    script = readme_job()
    assert RECORDER in script
    script = script.replace(RECORDER, RECORDER + ' inject=["update:step=2:rank=1:bit=28"],')
    (tmp_path / "mytrain.py").write_text(script, encoding="utf-8")
    (tmp_path / "slow_end.py").write_text(SLOW_END, encoding="utf-8")
    code, _, err, _ = torchrun(nproc, [str(tmp_path / "slow_end.py")], timeout_s=TIMEOUT_S, cwd=tmp_path)
    assert code == 1, err[-3000:]  # torchrun's own status when a worker fails; its report has each rank's
    assert _process_exit_codes(err) == {rank: ALARM_EXIT_CODE for rank in range(nproc)}, err[-3000:]
    assert (
        err.count("sdc-forensics: training stopped by an online check (exit 18): weights check fired at step 2")
        == nproc
    )
