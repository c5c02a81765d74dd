"""Training: state, losses, optimizer schedules, the jitted step and the loop."""
