"""One precedence for the collectives' settings on every path: code > a stack's section >
``SLIPSTREAM_*`` > defaults, and a bad value anywhere refused naming its key or variable."""

import pytest

from slipstream.config import CommConfig, SlipstreamConfig

ENV = {"SLIPSTREAM_CHUNK_BYTES": "1048576", "SLIPSTREAM_SHM": "0"}


@pytest.mark.parametrize(
    "code, section, environ, chunk, shm",
    [
        (None, None, {}, 4 << 20, True),  # defaults
        (None, None, ENV, 1 << 20, False),  # environment over defaults
        (None, {"chunk_bytes": 2 << 20}, ENV, 2 << 20, False),  # section over environment, per key
        (CommConfig(chunk_bytes=128), {"chunk_bytes": 2 << 20}, ENV, 128, True),  # code over all
    ],
)
def test_precedence_code_section_environment_defaults(code, section, environ, chunk, shm):
    cfg = CommConfig.resolve(code=code, section=section, environ=environ)
    assert (cfg.chunk_bytes, cfg.shm) == (chunk, shm)


def test_a_stacks_section_honours_the_environment():
    cfg = SlipstreamConfig.from_dict({"comm": {"slot_bytes": 4096, "small_bytes": 512}}, environ=ENV)
    assert (cfg.comm.slot_bytes, cfg.comm.chunk_bytes, cfg.comm.shm) == (4096, 1 << 20, False)


@pytest.mark.faults
@pytest.mark.parametrize(
    "environ, message",
    [
        ({"SLIPSTREAM_CHUNK_BYTES": "100"}, "SLIPSTREAM_CHUNK_BYTES='100': chunk_bytes must be a positive multiple of 64"),
        ({"SLIPSTREAM_TIMEOUT_S": "nan"}, "SLIPSTREAM_TIMEOUT_S='nan': timeout_s must be a positive finite"),
        ({"SLIPSTREAM_TIMEOUT_S": "inf"}, "SLIPSTREAM_TIMEOUT_S='inf'"),
        ({"SLIPSTREAM_SHM": "maybe"}, "SLIPSTREAM_SHM='maybe'"),
        ({"SLIPSTREAM_CONNECTIONS": "x"}, "SLIPSTREAM_CONNECTIONS='x'"),
    ],
)
def test_a_bad_variable_is_refused_by_name_on_every_path(environ, message):
    for parse in (lambda: CommConfig.from_env(environ), lambda: SlipstreamConfig.from_dict({}, environ=environ)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            parse()


@pytest.mark.faults
@pytest.mark.parametrize(
    "section, message",
    [
        ({"comm": {"chunk_bytes": 100}}, "slipstream.comm.chunk_bytes: chunk_bytes must be a positive multiple"),
        ({"comm": {"timeout_s": float("nan")}}, "slipstream.comm.timeout_s: timeout_s must be a positive finite"),
        ({"varlen": "yes"}, "slipstream.varlen must be an object"),
        ({"varlen": None}, "slipstream.varlen must be an object"),
        ({"varlen": {"enable": True}}, "allowed keys: backend, compile, enabled, logits"),
    ],
)
def test_a_bad_section_value_is_refused_by_key(section, message):
    with pytest.raises(ValueError, match=message):
        SlipstreamConfig.from_dict(section, environ={})


@pytest.mark.faults
def test_a_bad_section_key_is_refused_even_when_code_gives_the_config():
    with pytest.raises(ValueError, match="slipstream.comm: unknown key 'chunk'"):
        SlipstreamConfig.from_dict({"comm": {"chunk": 1}}, code=CommConfig())


@pytest.mark.parametrize("name, text", [
    ("s.json", '{"enabled": true, "varlen": {"enabled": true}, "comm": {"chunk_bytes": 65536}}'),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "slipstream": {"varlen": {"enabled": true}, "comm": {"chunk_bytes": 65536}}}'),
    ("s.yaml", "enabled: true\nvarlen: {enabled: true}\ncomm:\n  chunk_bytes: 65536\n"),
])
def test_slipstream_config_names_a_json_or_yaml_file_of_the_same_section(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    settings = SlipstreamConfig.from_env({"SLIPSTREAM_CONFIG": str(path)})
    assert settings.enabled and settings.varlen is not None and settings.comm.chunk_bytes == 65536
    assert SlipstreamConfig.from_env({}) is None


@pytest.mark.faults
@pytest.mark.parametrize("text, message", [
    ('{"varlen": {"enable": true}}', r"s.json: slipstream.varlen: unknown key 'enable' \(did you mean 'enabled'\?\)"),
    ("{nope", r"s.json: not valid JSON"),
    ('{"comm": {"chunk_bytes": 100}}', r"s.json: slipstream.comm.chunk_bytes"),
])
def test_a_bad_slipstream_config_file_is_refused_naming_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        SlipstreamConfig.from_env({"SLIPSTREAM_CONFIG": str(path)})
    with pytest.raises(ValueError, match="cannot read it"):
        SlipstreamConfig.from_env({"SLIPSTREAM_CONFIG": str(tmp_path / "missing.json")})
