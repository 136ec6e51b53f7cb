"""The step program and its call path: plan, reduce_step, update, the runner, `Step`."""
