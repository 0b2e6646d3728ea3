//! Charts as SVG: bus bandwidth against message size (the sweep), and any set of lines against
//! a log2 axis (the peers' ratios).

use std::path::Path;

use plotters::prelude::*;

use crate::cli::format_size;
use crate::metrics::{algbw_gbps, bus_factor};
use crate::runner::{Outcome, RowResult};

/// matplotlib's tab10: distinguishable on white, unlike the palettes' yellows.
const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// One line per (requested strategy, precision): busbw in GB/s against log2(bytes per rank).
fn series(rows: &[RowResult], world: usize) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for row in rows {
        let Outcome::Done(m) = &row.outcome else {
            continue;
        };
        if row.spec.bytes == 0 {
            continue;
        }
        let label = format!("{} / {}", row.spec.strategy, row.spec.precision);
        let point = (
            (row.spec.bytes as f64).log2(),
            algbw_gbps(row.spec.bytes, m.seconds) * bus_factor(world),
        );
        match out.iter_mut().find(|(l, _)| *l == label) {
            Some((_, pts)) => pts.push(point),
            None => out.push((label, vec![point])),
        }
    }
    for (_, pts) in &mut out {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Draw the measured rows of `rows` into the SVG file `path`.
pub fn draw(path: &Path, title: &str, rows: &[RowResult], world: usize) -> Result<(), String> {
    let lines = series(rows, world);
    if lines.is_empty() {
        return Err("nothing to plot: no row with a non-zero size was measured".into());
    }
    draw_lines(
        path,
        title,
        &Axes {
            x_desc: "message size per rank (bytes, log2 scale)",
            y_desc: "bus bandwidth (GB/s)",
            x_label: &|x| format_size(2f64.powf(x).round() as usize),
            reference: None,
        },
        &lines,
    )
}

/// What a chart's axes say: descriptions, how an x value (a log2) is labelled, and an optional
/// horizontal reference line (1.0 on a ratio chart).
pub struct Axes<'a> {
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub x_label: &'a dyn Fn(f64) -> String,
    pub reference: Option<f64>,
}

/// One line per (label, points), points (x, y) with x a log2; y from 0 up.
pub fn draw_lines(
    path: &Path,
    title: &str,
    axes: &Axes,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let lines: Vec<&(String, Vec<(f64, f64)>)> =
        lines.iter().filter(|(_, p)| !p.is_empty()).collect();
    if lines.is_empty() {
        return Err("nothing to plot: no point was measured".into());
    }
    let xs = lines.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x));
    let x_lo = xs.clone().fold(f64::INFINITY, f64::min).floor();
    let mut x_hi = xs.fold(f64::NEG_INFINITY, f64::max).ceil();
    if x_hi <= x_lo {
        x_hi = x_lo + 1.0;
    }
    let y_max = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .chain(axes.reference)
        .fold(0.0, f64::max);
    let y_hi = if y_max > 0.0 && y_max.is_finite() {
        y_max * 1.1
    } else {
        1.0
    };
    // One tick per power of two (plotters picks steps of 1, 2, 5, ... within this count).
    let ticks = ((x_hi - x_lo) as usize + 1).min(25);

    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (1024, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_lo..x_hi, 0f64..y_hi)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_labels(ticks)
        .x_desc(axes.x_desc)
        .y_desc(axes.y_desc)
        .x_label_formatter(&|x| (axes.x_label)(*x))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()
        .map_err(|e| err(&e))?;
    if let Some(r) = axes.reference {
        chart
            .draw_series(LineSeries::new(
                [(x_lo, r), (x_hi, r)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| err(&e))?;
    }
    for (i, (label, pts)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()].to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_chart_is_written_and_an_empty_one_refused() {
        let path = std::env::temp_dir().join(format!("allreduce-plot-{}.svg", std::process::id()));
        let axes = Axes {
            x_desc: "bytes",
            y_desc: "ours / best peer",
            x_label: &|x| format_size(2f64.powf(x).round() as usize),
            reference: Some(1.0),
        };
        let lines = vec![
            ("eager".to_string(), vec![(4.0, 0.9), (10.0, 1.2)]),
            ("graph".to_string(), vec![(4.0, 1.5), (10.0, 1.1)]),
        ];
        draw_lines(&path, "t", &axes, &lines).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(svg.contains("<svg") && svg.contains("eager") && svg.contains("graph"));
        let e = draw_lines(&path, "t", &axes, &[("x".into(), vec![])]).unwrap_err();
        assert!(e.contains("nothing to plot"), "{e}");
    }
}
