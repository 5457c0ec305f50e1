"""The runnable processes: worker, embedded server launcher, client, CLI."""
