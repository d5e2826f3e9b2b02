"""What `dgemma bench` measures with: systems timed turn about with their memory peaks (timing.py), a fresh
process timed to its first canvas (startup.py), and the random-weight models it runs (models.py)."""
