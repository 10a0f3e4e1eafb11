"""The mirror job as a ``spark-submit`` application: ``__main__.py`` here is the file
spark-submit runs (alone in its folder, so that no module beside it shadows a standard one when
Python puts the folder first on ``sys.path``)."""

from pathlib import Path

APP = Path(__file__).resolve().parent / "__main__.py"
"""The application file to give spark-submit."""
