//! The report's plots (`cargo xtask bench`): data in, SVG text out, nothing else — no files,
//! no fonts (plotters with only its SVG backend: labels are SVG `<text>` the browser sets), no
//! measuring. [`render`] draws a [`Plot`]: one or more series of points, joined by lines or not,
//! on linear or logarithmic axes, or over named categories on the x axis.

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// Pixels of every plot.
const SIZE: (u32, u32) = (760, 420);

/// Colours of the series in turn (Okabe–Ito: told apart with any colour vision).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(120, 120, 120),
    RGBColor(0, 0, 0),
];

/// One plot: what [`render`] draws, as kept in the report's JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plot {
    /// The file name without `.svg` (`docs/plots/<id>.svg`).
    pub id: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    #[serde(default)]
    pub x_log: bool,
    #[serde(default)]
    pub y_log: bool,
    /// When not empty, the x axis names these categories and a point's x is a category's
    /// index (0, 1, …).
    #[serde(default)]
    pub categories: Vec<String>,
    pub series: Vec<Series>,
}

/// One series: its points (x, y) and whether lines join them (else points only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    #[serde(default)]
    pub line: bool,
}

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlotError {
    #[error("plot {0}: no points to draw")]
    Empty(String),
    #[error("plot {id}: {what} value {value} cannot be drawn on a {axis} axis")]
    BadValue { id: String, what: &'static str, value: f64, axis: &'static str },
    #[error("plot {id}: x = {x} is not a category index (0..{n})")]
    NotACategory { id: String, x: f64, n: usize },
    #[error("plot {0}: drawing failed: {1}")]
    Draw(String, String),
}

/// An axis' drawn range, in the drawn coordinate (log10 of the value on a log axis).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    pub lo: f64,
    pub hi: f64,
}

impl Plot {
    /// Every point in drawn coordinates, checked: finite, positive on a log axis, a category
    /// index when the x axis has categories.
    fn drawn(&self) -> Result<Vec<Vec<(f64, f64)>>, PlotError> {
        let id = || self.id.clone();
        let axis = |v: f64, log: bool, what: &'static str| -> Result<f64, PlotError> {
            let kind = if log { "logarithmic" } else { "linear" };
            if !v.is_finite() || (log && v <= 0.0) {
                return Err(PlotError::BadValue { id: id(), what, value: v, axis: kind });
            }
            Ok(if log { v.log10() } else { v })
        };
        self.series
            .iter()
            .map(|s| {
                s.points
                    .iter()
                    .map(|&(x, y)| {
                        let n = self.categories.len();
                        if n > 0 && (x < 0.0 || x.fract() != 0.0 || x >= n as f64) {
                            return Err(PlotError::NotACategory { id: id(), x, n });
                        }
                        Ok((axis(x, self.x_log && n == 0, "x")?, axis(y, self.y_log, "y")?))
                    })
                    .collect()
            })
            .collect()
    }

    /// The x and y ranges drawn: the data's, widened by 5% (and y by 10% more at the top, for
    /// the legend; a linear y axis of non-negative data starts at 0; categories get half a slot
    /// on each side).
    pub fn ranges(&self) -> Result<(Range, Range), PlotError> {
        let pts: Vec<(f64, f64)> = self.drawn()?.into_iter().flatten().collect();
        if pts.is_empty() {
            return Err(PlotError::Empty(self.id.clone()));
        }
        let span = |vals: &mut dyn Iterator<Item = f64>| {
            vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)))
        };
        let widen = |(lo, hi): (f64, f64)| {
            let pad = if hi > lo { (hi - lo) * 0.05 } else { lo.abs().max(1.0) * 0.1 };
            Range { lo: lo - pad, hi: hi + pad }
        };
        let x = if self.categories.is_empty() {
            widen(span(&mut pts.iter().map(|p| p.0)))
        } else {
            Range { lo: -0.5, hi: self.categories.len() as f64 - 0.5 }
        };
        let (ylo, yhi) = span(&mut pts.iter().map(|p| p.1));
        let mut y = widen((ylo, yhi));
        if !self.y_log && ylo >= 0.0 {
            y.lo = 0.0;
        }
        // Room at the top for the legend.
        y.hi += (y.hi - y.lo) * 0.1;
        Ok((x, y))
    }
}

/// A tick label: three significant digits, `k` and `M` for thousands and millions.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        format!("{:.3}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        let s = if a >= 1.0 { format!("{v:.2}") } else { format!("{v:.3}") };
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// A log axis' tick label: the value at the tick, to two significant digits (the ticks are
/// evenly spaced in log10, so 10^1.3 = 19.95 is labelled 20).
fn log_tick(v: f64) -> String {
    let x = 10f64.powf(v);
    let scale = 10f64.powi(x.abs().log10().floor() as i32 - 1);
    tick((x / scale).round() * scale)
}

/// The corner of the plotting area with the fewest points (drawn coordinates), for the legend.
fn legend_corner(series: &[Vec<(f64, f64)>], x: Range, y: Range) -> SeriesLabelPosition {
    let f = |v: f64, r: Range| (v - r.lo) / (r.hi - r.lo).max(f64::MIN_POSITIVE);
    let mut count = [0usize; 4];
    for &(px, py) in series.iter().flatten() {
        let (fx, fy) = (f(px, x), f(py, y));
        // The legend covers less than half of each axis.
        let (left, right, low, high) = (fx < 0.45, fx > 0.55, fy < 0.45, fy > 0.55);
        for (i, inside) in [high && left, high && right, low && right, low && left].into_iter().enumerate() {
            count[i] += usize::from(inside);
        }
    }
    let best = (0..4).min_by_key(|&i| count[i]).unwrap_or(0);
    [
        SeriesLabelPosition::UpperLeft,
        SeriesLabelPosition::UpperRight,
        SeriesLabelPosition::LowerRight,
        SeriesLabelPosition::LowerLeft,
    ][best]
        .clone()
}

/// Draw `p` as an SVG document.
pub fn render(p: &Plot) -> Result<String, PlotError> {
    let (x, y) = p.ranges()?;
    let series = p.drawn()?;
    let corner = legend_corner(&series, x, y);
    let err = |e: &dyn std::fmt::Display| PlotError::Draw(p.id.clone(), e.to_string());
    let cats = &p.categories;
    let x_log = p.x_log && cats.is_empty();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&p.title, ("sans-serif", 18))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x.lo..x.hi, y.lo..y.hi)
            .map_err(|e| err(&e))?;
        // A log axis is drawn linear in log10 of the value; its labels name the value.
        let x_fmt = |v: &f64| {
            if cats.is_empty() {
                if x_log {
                    log_tick(*v)
                } else {
                    tick(*v)
                }
            } else if (v - v.round()).abs() < 1e-9 && *v >= 0.0 {
                cats.get(v.round() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let y_fmt = |v: &f64| if p.y_log { log_tick(*v) } else { tick(*v) };
        // About two labels per decade on a log axis (the grid's step is then half a decade or
        // a whole one).
        let decades = |r: Range| (((r.hi - r.lo) * 2.0).ceil() as usize + 1).max(5);
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(&p.x_label).y_desc(&p.y_label).x_label_formatter(&x_fmt).y_label_formatter(&y_fmt);
        if !cats.is_empty() {
            // A tick at every half slot: the categories' indices get their names.
            mesh.x_labels(cats.len() * 2 + 1);
        } else if x_log {
            mesh.x_labels(decades(x));
        }
        if p.y_log {
            mesh.y_labels(decades(y));
        }
        mesh.draw().map_err(|e| err(&e))?;
        for (i, (s, pts)) in p.series.iter().zip(&series).enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let drawn = if s.line {
                chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            } else {
                chart.draw_series(pts.iter().map(|&q| Circle::new(q, 4, color.filled())))
            };
            drawn.map_err(|e| err(&e))?.label(&s.label).legend(move |(lx, ly)| {
                PathElement::new(vec![(lx, ly), (lx + 18, ly)], color.stroke_width(3))
            });
            if s.line {
                chart
                    .draw_series(pts.iter().map(|&q| Circle::new(q, 3, color.filled())))
                    .map_err(|e| err(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .position(corner)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plot(series: Vec<Series>) -> Plot {
        Plot {
            id: "t".into(),
            title: "Latency CDF".into(),
            x_label: "µs".into(),
            y_label: "share".into(),
            x_log: false,
            y_log: false,
            categories: vec![],
            series,
        }
    }

    fn s(label: &str, points: &[(f64, f64)], line: bool) -> Series {
        Series { label: label.into(), points: points.to_vec(), line }
    }

    #[test]
    fn the_svg_parses_and_holds_every_series() {
        let p = plot(vec![
            s("tessera", &[(10.0, 0.1), (20.0, 0.5), (40.0, 0.99)], true),
            s("qsd tuned", &[(15.0, 0.1), (30.0, 0.5), (90.0, 0.99)], false),
        ]);
        let svg = render(&p).expect("render");
        let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
        for want in ["tessera", "qsd tuned", "Latency CDF", "µs", "share"] {
            assert!(texts.iter().any(|t| t.contains(want)), "no text {want:?} in {texts:?}");
        }
        // The line series is a polyline; the point series 3 circles, the line's points 3 more.
        assert!(doc.descendants().any(|n| n.tag_name().name() == "polyline"));
        assert!(doc.descendants().filter(|n| n.tag_name().name() == "circle").count() >= 6);
    }

    #[test]
    fn ranges_cover_the_data_with_a_margin_and_zero_based_y() {
        let p = plot(vec![s("a", &[(1.0, 10.0), (5.0, 30.0)], true), s("b", &[(3.0, 20.0)], false)]);
        let (x, y) = p.ranges().expect("ranges");
        assert!((x.lo - 0.8).abs() < 1e-9 && (x.hi - 5.2).abs() < 1e-9, "{x:?}");
        assert_eq!(y.lo, 0.0);
        // 30 + 5% of 20, then 10% of the 0..31 range.
        assert!((y.hi - 34.1).abs() < 1e-9, "{y:?}");
    }

    #[test]
    fn log_axes_range_over_decades() {
        let mut p = plot(vec![s("build", &[(1e3, 0.5), (1e5, 20.0)], true)]);
        p.x_log = true;
        p.y_log = true;
        let (x, y) = p.ranges().expect("ranges");
        assert!((x.lo - 2.9).abs() < 1e-9 && (x.hi - 5.1).abs() < 1e-9, "{x:?}");
        assert!(y.lo < 0.5f64.log10() && y.hi > 20f64.log10(), "{y:?}");
        assert_eq!(log_tick(1.3), "20");
        assert_eq!(log_tick(3.5), "3200");
        assert_eq!(log_tick(-0.5), "0.32");
        assert_eq!(tick(1000.0), "1000");
        assert_eq!(tick(1e5), "100k");
        assert_eq!(tick(2.5e6), "2.500M");
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(1.0), "1");
        assert_eq!(tick(12.5), "12.5");
        let svg = render(&p).expect("render");
        assert!(svg.contains(">\n1000\n<") || svg.contains(">1000<"), "no decade tick 1000");
    }

    #[test]
    fn categories_name_the_x_ticks() {
        let mut p = plot(vec![
            s("cold", &[(0.0, 1.5), (1.0, 2.5)], false),
            s("peer", &[(0.0, 9.0), (1.0, 12.0)], false),
        ]);
        p.categories = vec!["python".into(), "gcc".into()];
        let (x, _) = p.ranges().expect("ranges");
        assert_eq!((x.lo, x.hi), (-0.5, 1.5));
        let svg = render(&p).expect("render");
        assert!(svg.contains("python") && svg.contains("gcc"));
        p.series[0].points.push((2.0, 1.0));
        assert!(matches!(p.ranges(), Err(PlotError::NotACategory { .. })));
    }

    #[test]
    fn empty_or_undrawable_data_is_an_error_not_a_panic() {
        assert_eq!(render(&plot(vec![])), Err(PlotError::Empty("t".into())));
        assert_eq!(render(&plot(vec![s("a", &[], true)])), Err(PlotError::Empty("t".into())));
        assert!(matches!(
            render(&plot(vec![s("a", &[(1.0, f64::NAN)], true)])),
            Err(PlotError::BadValue { what: "y", .. })
        ));
        let mut p = plot(vec![s("a", &[(0.0, 1.0)], true)]);
        p.x_log = true;
        assert!(matches!(render(&p), Err(PlotError::BadValue { what: "x", .. })));
        // One point (a zero-width range) still draws.
        assert!(render(&plot(vec![s("a", &[(2.0, 3.0)], false)])).is_ok());
    }

    #[test]
    fn the_json_form_round_trips() {
        let p = plot(vec![s("a", &[(1.0, 2.0)], true)]);
        let back: Plot = serde_json::from_str(&serde_json::to_string(&p).expect("json")).expect("parse");
        assert_eq!(back, p);
    }
}
