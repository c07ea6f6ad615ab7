"""course.ipynb, the course's notebook: committed without outputs, and run top to bottom as a class would
(slow): in a copy of the project, so nothing is written here, with COURSE_QUICK=1 (3 iterations a phase);
every cell runs without an error, the demo's plot is shown and its logs' table printed."""

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
NOTEBOOK = ROOT / "course.ipynb"
WHY = "the notebook's tests: pip install nbclient nbformat ipykernel"


def test_the_notebook_is_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat", reason=WHY)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "REPO_URL" in code[0].source and "transformers==5.24.0" in code[0].source  # the set-up cell (Colab)


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason=WHY)
    nbclient = pytest.importorskip("nbclient", reason=WHY)
    pytest.importorskip("ipykernel", reason=WHY)
    project = tmp_path / "project"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache",
                                                                 ".benchmarks"))
    monkeypatch.setenv("COURSE_QUICK", "1")  # (the kernel and the runs it starts inherit it)
    notebook = nbformat.read(project / "course.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(project)}}).execute()  # (raises at a failing cell)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    images = [output for output in outputs if "image/png" in output.get("data", {})]
    tables = [output.data["text/markdown"] for output in outputs if "text/markdown" in output.get("data", {})]
    assert len(images) == 2  # the demo's plot, lab 3's study.png
    assert any(text.startswith("| phase | iteration | success | val_success |") for text in tables)
    assert any(text.startswith("| report of |") and "| student |" in text for text in tables)
    assert (project / "runs" / "notebook-demo" / "plot.png").is_file()
    for lab in ("notebook-course/seed0/retireopd", "notebook-course/seed0/opd", "notebook-lambda/seed0/retireopd"):
        assert (project / "runs" / lab / "student" / "retireopd.json").is_file(), lab  # each lab's runs finished
