"""Recovery: distillation from the unpruned model into the pruned one, after the surgery.

The teacher is the run's base model, the student its pruned model in its pruned shape;
the loss is token-level forward KL(teacher || student) (`loss`), the data are the
teacher's own samples or any data source the recipes accept (`data`), the teacher's
distributions come from the resident teacher or from a top-k cache on disk (`teacher`),
and `train` runs the loop (optimizer, schedule, validation guard, checkpoints, several
processes). `pruner.runs.recovery_stage` calls it as one more stage of a run.
"""
