"""Readers: the real .xrdml files, hand-made xrdml variants, xy files, readable errors."""
import numpy as np
import pytest

from neon_hpc.envs.xrd.science.readers import (
    PatternFormatError,
    read_pattern,
    read_xrdml,
    read_xy,
    to_uniform,
    write_xy,
)
from neon_hpc.envs.xrd.science.real import parse_mixture_name, parse_reaction_name, real_data_dir

XRDML = """<?xml version="1.0"?>
<xrdMeasurements xmlns="http://www.xrdml.com/XRDMeasurement/2.3">
 <sample><id>demo</id></sample>
 <xrdMeasurement><usedWavelength><kAlpha1 unit="Angstrom">1.7890</kAlpha1><kAlpha2 unit="Angstrom">1.7929</kAlpha2>
 <ratioKAlpha2KAlpha1>0.5</ratioKAlpha2KAlpha1></usedWavelength>
 <scan><dataPoints>{positions}<counts unit="counts">{counts}</counts></dataPoints></scan></xrdMeasurement>
</xrdMeasurements>"""


def test_start_end_positions(tmp_path):
    f = tmp_path / "a.xrdml"
    f.write_text(XRDML.format(positions='<positions axis="2Theta"><startPosition>10</startPosition>'
                              '<endPosition>20</endPosition></positions>', counts=" ".join(["5"] * 11)))
    m = read_xrdml(f)
    np.testing.assert_allclose(m.two_theta, np.linspace(10, 20, 11))
    assert m.wavelength == pytest.approx(1.789) and m.sample_id == "demo" and m.intensity.sum() == 55


def test_list_positions(tmp_path):
    f = tmp_path / "b.xrdml"
    f.write_text(XRDML.format(positions='<positions axis="2Theta"><listPositions>1 2 4</listPositions></positions>',
                              counts="1 2 3"))
    np.testing.assert_allclose(read_pattern(f).two_theta, [1, 2, 4])
    x, y = to_uniform(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(x, [1.0, 2.5, 4.0])


@pytest.mark.parametrize("body,needle", [
    ("<not-xml", "not valid XML"),
    ('<?xml version="1.0"?><x/>', "no <dataPoints>"),
    (XRDML.format(positions='<positions axis="2Theta"><listPositions>1 2</listPositions></positions>', counts="1 2 3"),
     "2 2Theta positions for 3 counts"),
])
def test_bad_xrdml_names_file_and_problem(tmp_path, body, needle):
    f = tmp_path / "bad.xrdml"
    f.write_text(body)
    with pytest.raises(PatternFormatError) as e:
        read_xrdml(f)
    assert "bad.xrdml" in str(e.value) and needle in str(e.value)


def test_xy_roundtrip_and_errors(tmp_path):
    x = np.linspace(10, 80, 50)
    y = np.sin(x) ** 2 * 100
    write_xy(tmp_path / "p.xy", x, y)
    m = read_xy(tmp_path / "p.xy")
    np.testing.assert_allclose(m.two_theta, x, atol=1e-5)
    np.testing.assert_allclose(m.intensity, y, atol=1e-5)
    (tmp_path / "c.csv").write_text("2theta,I\n" + "\n".join(f"{a},{b}" for a, b in zip(x, y)))
    assert len(read_pattern(tmp_path / "c.csv").two_theta) == 50
    (tmp_path / "q.xy").write_text("\n".join(f"{a} {b}" for a, b in zip(x, y)) + "\n12 abc\n")
    with pytest.raises(PatternFormatError, match=r"q.xy:51"):
        read_xy(tmp_path / "q.xy")


def test_file_names_of_the_real_data_parse():
    assert parse_mixture_name("NiO_0p1031-La(OH)3_0p2025-TiO2_0p7014--8min") == (
        [("NiO", 0.1031), ("La(OH)3", 0.2025), ("TiO2", 0.7014)], "8min")
    assert parse_reaction_name("2FeC2O4(H2O)2-Y2O3_200C_60min")[0] == ["FeC2O4(H2O)2", "Y2O3"]
    assert parse_reaction_name("CoO-WO3_900C_60min")[1]["temperature_C"] == 900


@pytest.mark.skipif(real_data_dir() is None, reason="shared/data/xrd-real not beside the repository "
                                                    "(set NEON_XRD_REAL_DATA)")
def test_reads_every_real_file():
    files = sorted(real_data_dir().rglob("*.xrdml"))
    assert len(files) >= 40
    for f in files:
        m = read_xrdml(f)
        assert m.two_theta[0] == pytest.approx(10.0, abs=0.1) and m.two_theta[-1] > 89
        assert len(m.two_theta) == len(m.intensity) > 1000 and m.intensity.max() > 100
        assert m.wavelength == pytest.approx(1.540598) and m.ka2_ratio == pytest.approx(0.5)
