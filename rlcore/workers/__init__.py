"""Ray actor classes: one rank each of the actor/rollout/ref and critic worker groups."""
