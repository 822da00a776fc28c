"""The bounded work queue, the batch planner and its cost model, and the session threads."""
