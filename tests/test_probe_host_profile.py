"""The host-profile probe's fold (scripts/probes/host_profile.py): py-spy's raw stacks counted a step,
only inside the timed loop, by group and by function, one column a profile."""

from pathlib import Path

PROFILE = (
    # root first, as py-spy's raw format writes a stack; the count last
    "<module> (host_profile.py:1);timed_loop (host_profile.py:2);mlx::core::eval_impl (libmlx.so);"
    "mlx::core::Matmul::eval_gpu (libmlx.so);cublasLtMatmul (libcublasLt.so.13) 6\n"
    "<module> (host_profile.py:1);timed_loop (host_profile.py:2);mlx::core::eval_impl (libmlx.so);"
    "mlx::core::fast::CustomKernel::eval_gpu (libmlx.so);0x7f00deadbeef (libcuda.so.580) 2\n"
    "<module> (host_profile.py:1);timed_loop (host_profile.py:2);mlx::core::detail::compile_replace (libmlx.so);"
    "malloc (libc.so.6) 2\n"
    # outside the timed loop (tracing, warm-up): not counted
    "<module> (host_profile.py:1);run (host_profile.py:3);mlx::core::Matmul::eval_gpu (libmlx.so) 50\n"
)


def _rows(text: str) -> dict[str, list[str]]:
    return {line[:42].strip(): line[42:].split() for line in text.splitlines() if line[:42].strip()}


def test_fold_counts_timed_samples_a_step_by_group_and_function(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts" / "probes"))
    from host_profile import fold

    one, two = tmp_path / "lora.txt", tmp_path / "dora.txt"
    one.write_text(PROFILE)
    (tmp_path / "lora.txt.steps").write_text("2")
    two.write_text(PROFILE.replace(" 6\n", " 16\n"))
    (tmp_path / "dora.txt.steps").write_text("4")
    fold([str(one), str(two)])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["all"] == ["5.0", "5.0"]  # 10 timed samples over 2 steps; 20 over 4
    assert rows["Matmul/AddMM eval_gpu"] == ["3.00", "(60.0%)", "4.00", "(80.0%)"]
    assert rows["CustomKernel::eval_gpu"][0] == "1.00" and rows["libcuda"][0] == "1.00"
    assert rows["compiled call (build)"][0] == "1.00" and rows["malloc (libc)"][0] == "1.00"
    # An unnamed frame keeps its library only, so two processes' addresses fold together.
    assert any(line.split()[:3] == ["[libcuda.so.580]", "1.00", "0.50"] for line in out.splitlines())
    short = fold.__globals__["_short"]("mlx::core::Foo<int, std::vector<float>>::bar(int const&) [libmlx.so]")
    assert short == "mlx::core::Foo::bar() [libmlx.so]"
