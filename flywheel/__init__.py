

# The distribution name on PyPI (`pip install flywheel-loop[serve]`). `flywheel` there is an
# unrelated project; the command and the import packages keep their names (D51).
DISTRIBUTION = "flywheel-loop"
