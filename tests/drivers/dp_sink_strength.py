"""lm-eval's own evaluator on HFLM under torchrun, ranks set as HFLM sets them on several GPUs.

Usage: [torchrun --standalone --nproc_per_node N] python dp_sink_strength.py MODEL TASK_DIR OUT_DIR
With ACCELERATE_USE_CPU=true the processes talk over gloo. Rank 0 saves the results and samples
under OUT_DIR as the lm_eval CLI does (`--output_path OUT_DIR --log_samples`).
"""

import sys

import lm_eval
from accelerate import Accelerator
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

model, task_dir, out = sys.argv[1:4]
lm = HFLM(pretrained=model, device="cpu", batch_size=1)
accelerator = Accelerator()
if accelerator.num_processes > 1:
    lm.accelerator = accelerator
    lm._rank = accelerator.local_process_index
    lm._world_size = accelerator.num_processes
tracker = EvaluationTracker(output_path=out)
res = lm_eval.simple_evaluate(
    model=lm,
    tasks=["sink_strength", "tiny_gen"],
    task_manager=TaskManager(include_path=task_dir),
    log_samples=True,
    evaluation_tracker=tracker,
)
if lm.rank == 0:
    res["config"]["world_size"] = lm.world_size
    samples = res.pop("samples")
    tracker.save_results_aggregated(results=res, samples=samples)
    for name in res["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
