"""The machine stamp (kit/results.py): every results table and tests/timings.json say which CPU, instruction sets,
BLAS and code path made their figures, and a table that times bf16 on a CPU without bf16 units says that its
bf16 rows are emulated (issue 38: one committed bf16 row was 0.66× fp32, on an AVX2 CPU it is 12–14×)."""

from __future__ import annotations

import csv
import io
import json
import platform
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from kit import bench, results

STAMP_FIELDS = {"cpu", "arch", "os", "cores", "isa", "native_bf16", "torch_cpu_capability", "blas", "mkl", "onednn",
                "code_path_env", "torch_threads", "torch", "triton"}

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu sse2 avx fma avx2 bmi2
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0c
"""


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    """Make this process see a CPU of our choosing: ``cpu(arch, model, flags)``; no CUDA device either."""

    def pretend(arch: str, model: str, flags: set[str] | None) -> None:
        monkeypatch.setattr(results, "cpu_identity", lambda: (model, None if flags is None else frozenset(flags)))
        monkeypatch.setattr(platform, "machine", lambda: arch)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    return pretend


def test_the_stamp_has_every_field_with_this_machines_values() -> None:
    stamp = results.machine_stamp()
    assert set(stamp) == STAMP_FIELDS, sorted(set(stamp) ^ STAMP_FIELDS)
    assert stamp["cpu"] and stamp["arch"] == platform.machine() and stamp["cores"] >= 1
    assert stamp["torch"] == torch.__version__ and stamp["torch_threads"] == torch.get_num_threads()
    assert stamp["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert stamp["native_bf16"] in (True, False, None)
    assert stamp["isa"] is None or set(stamp["isa"]) <= {i for isa in results.RELEVANT_ISA.values() for i in isa}
    assert stamp["blas"], "torch.__config__.show() names its BLAS (BLAS_INFO)"
    json.dumps(stamp)  # it goes into JSON files as it is


def test_code_path_variables_are_stamped_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    env = results.machine_stamp()["code_path_env"]
    assert env.get("MKL_CBWR") == "AVX2" and "ATEN_CPU_CAPABILITY" not in env


def test_cpuinfo_gives_the_model_and_flags_on_x86_and_arm() -> None:
    model, flags = results.parse_cpuinfo(X86_CPUINFO)
    assert model == "Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz" and {"avx2", "fma"} <= flags
    assert results.relevant_isa("x86_64", flags) == ["avx2"]
    model, flags = results.parse_cpuinfo(ARM_CPUINFO)
    assert model == "ARM implementer 0x41, part 0xd0c" and "asimd" in flags and "bf16" not in flags
    assert results.relevant_isa("aarch64", flags) == ["asimd"]
    assert results.parse_cpuinfo("processor\t: 0\n") == (None, None)


@pytest.mark.parametrize("arch, flags, native", [
    ("x86_64", {"avx2", "fma"}, False),                      # the AVX2 laptop of issue 38
    ("x86_64", {"avx2", "avx512f"}, False),                  # AVX-512 without its bf16 extension
    ("x86_64", {"avx2", "avx512f", "avx512_bf16"}, True),    # Cooper Lake, Zen 4
    ("x86_64", {"avx2", "amx_tile", "amx_bf16"}, True),      # Sapphire Rapids
    ("aarch64", {"asimd"}, False),                           # Neoverse N1, Graviton 2
    ("aarch64", {"asimd", "sve", "bf16"}, True),             # Neoverse V1, Graviton 3
    ("arm64", {"asimd", "bf16"}, True),                      # Apple M2 (sysctl, named as Linux does)
    ("x86_64", None, None),                                  # flags unreadable
    ("riscv64", {"v"}, None),                                # an architecture the stamp does not know
])
def test_native_bf16_follows_the_flags(arch: str, flags: set[str] | None, native: bool | None) -> None:
    assert results.has_native_bf16(arch, None if flags is None else frozenset(flags)) is native


def test_a_cpu_without_bf16_units_gets_the_note(cpu) -> None:
    cpu("x86_64", "Fake AVX2 CPU", {"avx2", "fma"})
    stamp = results.machine_stamp()
    assert stamp["cpu"] == "Fake AVX2 CPU" and stamp["isa"] == ["avx2"] and stamp["native_bf16"] is False
    note = results.bf16_note(stamp)
    assert note is not None and "no bf16 units" in note and "avx512_bf16" in note and "slower than fp32" in note
    assert bench.bf16_notes(True) == [note]
    assert bench.bf16_notes(False) == [], "a table without bf16 rows needs no bf16 note"


def test_arm_without_bf16_names_arms_feature(cpu) -> None:
    cpu("aarch64", "ARM implementer 0x41, part 0xd0c", {"asimd"})
    note = results.bf16_note(results.machine_stamp())
    assert note is not None and "no bf16 units (no bf16)" in note


def test_a_cpu_with_bf16_units_or_a_gpu_gets_no_note(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu("x86_64", "Fake AMX CPU", {"avx2", "avx512f", "amx_tile", "amx_bf16"})
    assert results.bf16_note(results.machine_stamp()) is None and bench.bf16_notes(True) == []
    cpu("x86_64", "Fake AVX2 CPU", {"avx2"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.bf16_notes(True) == [], "bf16 rows on a GPU are not emulated"


def test_unreadable_flags_get_a_hedged_note(cpu) -> None:
    cpu("x86_64", "Unknown CPU", None)
    stamp = results.machine_stamp()
    assert stamp["isa"] is None and stamp["native_bf16"] is None
    assert "could not be read" in results.bf16_note(stamp)


def test_a_saved_table_carries_the_stamp_and_the_note(cpu, tmp_path: Path) -> None:
    cpu("x86_64", "Fake AVX2 CPU", {"avx2", "fma"})
    rows = [{"config": "fp32", "ms": 10.0}, {"config": "bf16", "ms": 130.0}]
    notes = bench.bf16_notes(True)
    paths = bench.save("demo", rows, Namespace(out=tmp_path, impl="reference"), title="Demo", notes=notes)

    saved = json.loads(paths["json"].read_text())
    machine = saved["environment"]["machine"]
    assert set(machine) == STAMP_FIELDS
    assert machine["cpu"] == "Fake AVX2 CPU" and machine["native_bf16"] is False and machine["isa"] == ["avx2"]
    assert saved["notes"] == notes and saved["rows"] == rows
    assert saved["environment"]["device"].startswith("CPU (Fake AVX2 CPU, x86_64")

    md = paths["md"].read_text()
    assert "machine: cpu: Fake AVX2 CPU · arch: x86_64" in md and "isa: avx2 ·" in md and "native_bf16: no" in md
    assert f"Note: {notes[0]}" in md and md.index("Note:") < md.index("| config |")

    text = paths["csv"].read_text()
    assert text.startswith("# device:")
    assert "# machine.cpu: Fake AVX2 CPU\n" in text and "# machine.native_bf16: no\n" in text
    assert f"# note: {notes[0]}\n" in text
    table = csv.DictReader(io.StringIO("".join(line for line in text.splitlines(True) if not line.startswith("#"))))
    assert [r["config"] for r in table] == ["fp32", "bf16"]


def test_timings_record_the_machine_stamp_per_stage(tmp_path: Path) -> None:
    """`python -m instructor timings` stamps each stage it re-records like a results table; the grader reads
    only the test times back."""
    from instructor import timings
    from kit.grading.timings import load

    test_file = tmp_path / "tests" / "test_stage1_demo.py"
    test_file.parent.mkdir()
    test_file.write_text("def test_a(): pass\n")
    written = timings.record({"tests/test_stage1_demo.py::test_a": [0.1, 0.2, 0.0, 0.3, 0.4]}, tmp_path,
                             "python -m instructor timings --stage 1")
    assert written == [tmp_path / "tests" / "timings.json"]
    stamp = json.loads(written[0].read_text())["recorded"]["stage 1"]
    assert set(stamp["machine"]) == STAMP_FIELDS and stamp["machine"]["cpu"]
    assert stamp["machine"]["torch_threads"] == 1, "the tests' workers run one thread each"
    assert stamp["command"] == "python -m instructor timings --stage 1" and stamp["date"] and stamp["load"]
    assert load(tmp_path) == {"tests/test_stage1_demo.py::test_a": [0.1, 0.2, 0.0, 0.3, 0.4]}
