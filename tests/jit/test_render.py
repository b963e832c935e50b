"""Rendering: params baked into the source, StrictUndefined errors named, exact float literals, and
rendered lines mapped back to template lines."""
from __future__ import annotations

import concurrent.futures
import re
import signal
import textwrap
import warnings

import numpy as np
import pytest

from deepjit_compiler.errors import KernelError
from deepjit_compiler.jit import render as render_module
from deepjit_compiler.jit.contracts import load_contract, resolve_params
from deepjit_compiler.jit.render import f32_literal, render, render_kernel

FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [[80, 80], [40, 40], [20, 20]], "input_dtype": "float32"}


def test_decode_source_bakes_site_facts_and_spec_params():
    _, src = render_kernel("yolov8_decode", {"conf_threshold": 0.3, "anchors_per_thread": 2}, {**FACTS, "num_classes": 7})
    assert "enum : int { NC = 7, REG = 16, V = 2, BLOCK = 128 };" in src.code
    assert "const int hw1 = 40 * 40;" in src.code                 # static levels are constants
    literal = re.search(r"float conf_threshold\(\) \{ return (\S+)f", src.code).group(1)
    assert float.fromhex(literal) == float(np.float32(0.3))      # the float32 the reference uses
    assert src.symbols == (("decode", "deepjit_yolov8_decode_candidates<float, 1>"),)
    assert src.headers[0][0] == "deepjit_common.cuh" and "/*@@" not in src.code


def test_dynamic_levels_read_sizes_from_kernel_args():
    facts = {**FACTS, "levels": [["H0", "W0"], ["H1", "W1"], ["H2", "W2"]], "anchors": "A"}
    _, src = render_kernel("yolov8_decode", {"mode": "output0"}, facts)
    assert "const int hw2 = args.h2 * args.w2;" in src.code
    assert "deepjit_yolov8_decode_output0" in src.code and "deepjit_yolov8_decode_candidates" not in src.code


@pytest.mark.parametrize("value", [0.25, 0.45, 0.1, 1e-3, 0.7])
def test_f32_literal_is_exact(value):
    literal = f32_literal(value).split("f ")[0]
    assert np.float32(float.fromhex(literal)) == np.float32(value)
    assert float.fromhex(literal) == float(np.float32(value))


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e39])
def test_f32_literal_of_no_finite_float32_is_a_kernel_error(value):
    """1e39 is past float32's range: it would be baked into the kernel as infinity. The error is all the
    user sees (no numpy overflow warning before it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KernelError, match=rf"kernel param {re.escape(repr(value))} is not a finite float32"):
            f32_literal(value)


def test_rendered_lines_map_back_to_template_lines():
    contract = load_contract("nms")
    src = render(contract, resolve_params(contract, {"max_det": 100}))
    template = contract.template_path.read_text().splitlines()
    rendered = src.code.splitlines()
    n = next(i for i, line in enumerate(rendered, 1) if "dj_nms::nms_image<MAX_DET, AGNOSTIC>(blockIdx.x" in line)
    file, line = src.origin(n)
    assert file == str(contract.template_path)
    assert "dj_nms::nms_image<MAX_DET, AGNOSTIC>(blockIdx.x" in template[line - 1]
    # a line made from params: the constants the shared NMS header reads
    n = next(i for i, line in enumerate(rendered, 1) if line == "#define DJ_NMS_BLOCK 512")
    assert template[src.origin(n)[1] - 1] == "#define DJ_NMS_BLOCK {{ block }}"
    rows = src.excerpt(n).splitlines()
    assert [row for row in rows if row.startswith(">")] == [f">{n:5d} | {rendered[n - 1]}"]
    assert [int(row[1:6]) for row in rows] == list(range(n - 3, n + 4))  # three lines either side


def test_comment_lines_leave_no_line_and_lines_without_a_mark_have_no_origin(tmp_path):
    """A `{# #}` line vanishes as a `{% %}` line does (trim_blocks); the first line of a multi-line value comes
    from no one template line."""
    _, src = render_kernel(_contract(tmp_path, "{# a note #}\n{{ 'a\\nb' }}\nextern \"C\" __global__ void k() {}"), {})
    assert src.code.splitlines() == ["a", "b", 'extern "C" __global__ void k() {}']
    template = str(tmp_path / "t.cu.j2")
    assert [src.origin(n) for n in (0, 1, 2, 3, 4)] == [None, None, (template, 2), (template, 3), None]


def _user_contract(tmp_path, template: str, params: str = "factor: {type: float, default: 2.0}"):
    (tmp_path / "mine.cu.j2").write_text(textwrap.dedent(template))
    (tmp_path / "mine.yaml").write_text(textwrap.dedent(f"""\
        name: mine
        template: mine.cu.j2
        params:
          {params}
        entry_points:
          - {{name: k, symbol: k, block: [1], grid: [1], args: []}}
        """))
    return load_contract(str(tmp_path / "mine.yaml"))


def test_undefined_variable_names_it_and_the_template_line(tmp_path):
    c = _user_contract(tmp_path, """\
        // line 1
        extern "C" __global__ void k(float* x) {
            x[0] *= {{ factr }};
        }
        """)
    with pytest.raises(KernelError, match=r"mine\.cu\.j2:3: 'factr' is undefined \(did you mean 'factor'\?\)"):
        render(c, resolve_params(c, {}))


def test_template_syntax_error_names_file_and_line(tmp_path):
    c = _user_contract(tmp_path, """\
        extern "C" __global__ void k(float* x) {
        {% if factor > 1 %}
            x[0] *= {{ factor }};
        }
        """)
    with pytest.raises(KernelError, match=r"mine\.cu\.j2:\d+: template syntax error"):
        render(c, resolve_params(c, {}))


def _contract(folder, source: str, **fields) -> str:
    """A one-entry contract in `folder` whose template t.cu.j2 holds `source`."""
    (folder / "t.cu.j2").write_text(source)
    lines = ["name: t", f"template: {fields.pop('template', 't.cu.j2')}",
             f"headers: {fields.pop('headers', [])}",
             "entry_points: [{name: k, symbol: k, block: [1], grid: [1], args: []}]"]
    (folder / "t.yaml").write_text("\n".join(lines) + "\n")
    return str(folder / "t.yaml")


def test_a_template_cannot_run_python(tmp_path):
    """Templates come from users and from pulled bundles: they render in Jinja's sandbox."""
    marker = tmp_path / "pwned"
    hostile = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}\n"
    with pytest.raises(KernelError, match=r"t.cu.j2:1: the template tried an unsafe operation"):
        render_kernel(_contract(tmp_path, hostile), {})
    assert not marker.exists()


@pytest.mark.parametrize("hostile", [
    "{{ '{0.__init__.__globals__[os].environ}'|attr('format')(cycler) }}\n",  # CVE-2025-27516: jinja2 < 3.1.6
    "{{ '{0.__init__.__globals__[os].environ}'.format(cycler) }}\n",
])
def test_a_template_cannot_read_python_through_str_format(tmp_path, monkeypatch, hostile):
    """Before jinja2 3.1.6 (pyproject asks for it) `|attr('format')` handed the template str's own format,
    unsandboxed: the environment, registry credentials with it, would be printed into the kernel's source
    and the bundle."""
    monkeypatch.setenv("DEEPJIT_TEST_SECRET", "hunter2-secret")
    with pytest.raises(KernelError, match=r"t.cu.j2:1: the template tried an unsafe operation \(access to attribute "
                                          r"'__init__' of 'type' object is unsafe\.\)") as e:
        render_kernel(_contract(tmp_path, hostile), {})
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"headers": "[/proc/self/environ]"}, "header '/proc/self/environ' must be a relative path inside"),
    ({"template": "/etc/passwd"}, "template '/etc/passwd' must be a relative path inside"),
    ({"template": "../outside.cu.j2"}, r"template '../outside.cu.j2' must be a relative path inside"),
    ({"headers": "[link.cuh]"}, "header 'link.cuh' is a link out of"),
])
def test_a_contract_reaches_only_its_own_folder(tmp_path, fields, message):
    folder = tmp_path / "mine"
    folder.mkdir()
    secret = tmp_path / "outside.cu.j2"
    secret.write_text("SECRET-CONTENT\n")
    (folder / "link.cuh").symlink_to(secret)
    with pytest.raises(KernelError, match=message) as e:
        render_kernel(_contract(folder, "extern \"C\" __global__ void k() {}\n", **fields), {})
    assert "SECRET" not in str(e.value) and "root:" not in str(e.value)


@pytest.mark.parametrize("include, message", [
    ("link.cuh", r"t\.yaml: template include 'link\.cuh' is a link out of"),
    ("../outside.cu.j2", r"t\.yaml: template include '\.\./outside\.cu\.j2' must be a relative path inside"),
])
def test_a_template_includes_only_from_its_own_folder(tmp_path, include, message):
    """Jinja's FileSystemLoader follows links: an {% include %} is confined as the template and headers are."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (tmp_path / "outside.cu.j2").write_text("SECRET-CONTENT\n")
    (folder / "link.cuh").symlink_to(tmp_path / "outside.cu.j2")
    with pytest.raises(KernelError, match=r"t\.cu\.j2:2: .*" + message) as e:
        render_kernel(_contract(folder, "// a kernel\n{% include '" + include + "' %}\n"), {})
    assert "SECRET" not in str(e.value)


def test_a_template_includes_files_of_its_folder_and_deepjits_templates(tmp_path):
    (tmp_path / "part.cuh").write_text("// my part\n")
    _, src = render_kernel(_contract(tmp_path, "{% include 'part.cuh' %}\n{% include 'deepjit_common.cuh' %}\n"), {})
    assert "// my part" in src.code and "#include <cuda_fp16.h>" in src.code


def test_a_template_includes_its_own_folders_file_before_deepjits_of_the_same_name(tmp_path):
    (tmp_path / "deepjit_common.cuh").write_text("// my own common\n")
    _, src = render_kernel(_contract(tmp_path, "{% include 'deepjit_common.cuh' %}\n"), {})
    assert src.code == "// my own common\n"


@pytest.mark.parametrize("source, message", [
    ("{% for i in range(10**6) %}{% endfor %}\n", r"OverflowError: Range too big"),
    ("{{ 'a' * 5000000 }}\n", r"OverflowError: repeating a str of 1 items 5000000 times .* the sandbox refuses it"),
    ("{{ 5000000 * 'a' }}\n", r"OverflowError: repeating a str of 1 items 5000000 times .* the sandbox refuses it"),
    ("{{ 2 ** 5000 }}\n", r"OverflowError: 2 \*\* 5000 has more than 4096 bits"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}\n", r"RecursionError"),
    ("{{ 'a'.ljust(10**10) }}\n", r"OverflowError: padding to a width of 10000000000 makes more than 4194304 characters"),
    ("{{ 'a'|center(10**10) }}\n", r"OverflowError: padding to a width of 10000000000 makes more than 4194304 characters"),
    ("{{ 'a'.rjust(10**10) }}\n", r"OverflowError: padding to a width of 10000000000 makes more than 4194304 characters"),
    ("{{ '7'.zfill(4194305) }}\n", r"OverflowError: padding to a width of 4194305 makes more than 4194304 characters"),
    ("{{ ('a' * 2000).replace('', 'b' * 4000) }}\n", r"OverflowError: replacing 2001 times makes more than 4194304"),
    ("{{ ('a\\n' * 1000)|indent('x' * 5000) }}\n", r"OverflowError: indenting by 'x+' makes more than 4194304 characters"),
    ("{{ ('ab' * 2000000).replace('a', 'aaa') }}\n", r"OverflowError: replacing 2000000 times makes more than 4194304"),
    ("{{ ('ab' * 2000000)|replace('a', 'aaa') }}\n", r"OverflowError: replacing 2000000 times makes more than 4194304"),
    ("{{ 'x'|indent(10**9) }}\n", r"OverflowError: indenting by 1000000000 makes more than 4194304 characters"),
    ("{{ 1|round(10**8, 'floor') }}\n", r"OverflowError: 10 \*\* 100000000 has more than 4096 bits"),
    ("{{ '\t'.expandtabs(10**9) }}\n", r"OverflowError: tabs of 1000000000 makes more than 4194304 characters"),
    ("{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}\n",
     r"OverflowError: the template renders more than 16777216 characters; the sandbox refuses it"),
])
def test_a_hostile_template_is_a_kernel_error_naming_its_files(tmp_path, source, message):
    """Any failure of a user's template is bad input (exit 2), not a DeepJIT bug (exit 3)."""
    path = _contract(tmp_path, source)
    with pytest.raises(KernelError, match=rf"t\.cu\.j2(:1)?: rendering the template of .*t\.yaml failed: {message}"):
        render_kernel(path, {})


def test_a_template_that_loops_silently_is_stopped(tmp_path, monkeypatch):
    """Nested loops that print nothing: each range is within the sandbox's bound, together 10**10 rounds
    (hours) that held the build, or a `validate` of a pulled bundle, with no output to bound."""
    monkeypatch.setattr(render_module, "RENDER_SECONDS", 0.5)
    path = _contract(tmp_path, "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}\n")
    with pytest.raises(KernelError, match=r"t\.cu\.j2:1: rendering the template of .*t\.yaml failed: TimeoutError: "
                                          r"the template renders for more than 0\.5 s; the sandbox refuses it"):
        render_kernel(path, {})
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off again


@pytest.mark.parametrize("source", [
    "{{ [1]|slice(1000000000000000)|max }}\n",
    "{{ ([[0]] * 4000000)|sum(start=[])|length }}\n",   # one C call (10**13 copies), deaf to SIGALRM
])
def test_a_template_that_loops_when_loaded_is_stopped(tmp_path, monkeypatch, source):
    """Loading a template folds its constants: the first looped for days in get_template, outside the render's
    deadline; and folding takes a TimeoutError for "not a constant", then loops again when rendered."""
    monkeypatch.setattr(render_module, "RENDER_SECONDS", 0.5)
    path = _contract(tmp_path, source)
    with pytest.raises(KernelError, match=r"t\.cu\.j2:1: rendering the template of .*t\.yaml failed: TimeoutError: "
                                          r"the template renders for more than 0\.5 s; the sandbox refuses it"):
        render_kernel(path, {})
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("source", [
    "{{ '%300000000d' % 1 }}\n",                                         # a printf width: one call, 300 MB
    "{{ '{:300000000}'.format(1) }}\n",
    "{% set ns = namespace(s='a' * 4000000) %}{% for i in range(7) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s|length }}\n",                                               # doubled, never printed: 512 MB
    # each item a new string of 40 MB, 320 MB in all (strings this large are mapped afresh: smaller ones may
    # reuse memory the process freed, which its address space already counts)
    "{{ ([(['a' * 4000000] * 10)|join] * 8)|map('upper')|list|length }}\n",
])
def test_a_template_that_builds_past_its_memory_bound_is_stopped(tmp_path, monkeypatch, source):
    """Each of these is within the sandbox's bounds on one operation (and prints little) yet took all the
    memory there was at full size (`'%9999999999d' % 1`, 40 doublings): the render's memory is bounded."""
    monkeypatch.setattr(render_module, "RENDER_BYTES", 64 << 20)
    with pytest.raises(KernelError, match=r"t\.cu\.j2(:1)?: rendering the template of .*t\.yaml failed: MemoryError: "
                                          r"the template needs more than 64 MiB of memory; the sandbox refuses it"):
        render_kernel(_contract(tmp_path, source), {})


def test_lorem_ipsum_is_not_in_the_sandbox(tmp_path):
    """`lipsum(n)` made n paragraphs, n unbounded; no kernel needs it."""
    with pytest.raises(KernelError, match=r"t\.cu\.j2:1: 'lipsum' is undefined"):
        render_kernel(_contract(tmp_path, "{{ lipsum(10**9) }}\n"), {})


@pytest.mark.parametrize("headers, says", [
    ("[gone.cuh]", r"t\.yaml: header 'gone\.cuh' not found in [^,]*mine, [^,]*templates$"),  # each folder once
    ("[sub]", r"t\.yaml: header 'sub' is not a file in .*mine; allowed: a file"),
    ("[part.cuh, part.cuh]", r"t\.yaml:3:\d+: headers: 'part\.cuh' is given twice; allowed: each once"),
])
def test_a_header_that_is_a_folder_or_given_twice_is_named(tmp_path, headers, says):
    """A folder was reported as 'not found', and a header given twice was accepted."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "sub").mkdir()
    (folder / "part.cuh").write_text("// part\n")
    with pytest.raises(KernelError, match=says):
        render_kernel(_contract(folder, "extern \"C\" __global__ void k() {}\n", headers=headers), {})


def test_a_render_leaves_no_timer_or_handler_behind(tmp_path):
    """The render's deadline is a SIGALRM timer: left armed after a render that finished, it would fire
    RENDER_SECONDS later into whatever runs then (with the default handler back, killing the process)."""
    before = signal.getsignal(signal.SIGALRM)
    _, src = render_kernel(_contract(tmp_path, "extern \"C\" __global__ void k() {}\n"), {})
    assert "void k()" in src.code
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_template_renders_outside_the_main_thread(tmp_path):
    """Only the main thread can take SIGALRM (signal.signal raises ValueError elsewhere): a server's worker
    thread renders without the deadline, its output still bounded."""
    path = _contract(tmp_path, "extern \"C\" __global__ void k() {}\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        _, src = pool.submit(render_kernel, path, {}).result()
    assert "void k()" in src.code
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hostile = _contract(tmp_path, "{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}\n")
        with pytest.raises(KernelError, match=r"OverflowError: the template renders more than 16777216 characters"):
            pool.submit(render_kernel, hostile, {}).result()


def test_the_bounded_str_methods_and_filters_still_work_within_their_bounds(tmp_path):
    """Each built the whole value in one call (`'a'.ljust(10**10)`) before any bound could see it; bounded now,
    they keep their meaning."""
    source = ("// {{ 'ab'.ljust(4) }}|{{ 'ab'|center(6) }}|{{ 'a-b'.replace('-', '+') }}|{{ 'a-b'|replace('-', '++', 1) }}"
              "|{{ '7'.zfill(3) }}|{{ 'x'|indent(2, true) }}|{{ 'a\tb'.expandtabs(2) }}"
              "|{{ '7'.zfill(4194304)|length }}|{{ ('a' * 4000).replace('a', 'b' * 4000, 1)|length }}"
              "|{{ ('a' * 4000).replace('a', 'b' * 4000, 0)|length }}\n")
    _, src = render_kernel(_contract(tmp_path, source), {})
    assert src.code.splitlines()[0] == "// ab  |  ab  |a+b|a++b|007|  x|a b|4194304|7999|4000"
