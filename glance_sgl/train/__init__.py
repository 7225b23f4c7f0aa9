"""Self-distillation data and the GLANCE drafter trainer (design §1, "Training")."""
