//! SVG plots: the sweep curve and the latency distribution.

use std::fmt::Display;
use std::path::Path;

use anyhow::anyhow;
use derp_load::measure::RttHistogram;
use plotters::prelude::*;

use crate::report::SweepStep;

fn plot_err<E: Display>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("drawing {}: {e}", path.display())
}

/// Offered against delivered Mbit/s (with the ideal y = x), and the undelivered share below.
pub(crate) fn sweep_svg(path: &Path, steps: &[SweepStep], title: &str) -> anyhow::Result<()> {
    let err = plot_err(path);
    let x_max = steps.iter().map(|s| s.offered_mbps).fold(1.0, f64::max) * 1.05;
    let y_max = steps
        .iter()
        .map(|s| s.load.delivered_mbps)
        .fold(x_max, f64::max);
    let root = SVGBackend::new(path, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let (upper, lower) = root.split_vertically(460);

    let mut chart = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("offered load, Mbit/s")
        .y_desc("delivered, Mbit/s")
        .draw()
        .map_err(&err)?;
    chart
        .draw_series(LineSeries::new(
            [(0.0, 0.0), (x_max, x_max)],
            ShapeStyle::from(&BLACK.mix(0.3)).stroke_width(1),
        ))
        .map_err(&err)?
        .label("offered = delivered")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.3)));
    let delivered: Vec<(f64, f64)> = steps
        .iter()
        .map(|s| (s.offered_mbps, s.load.delivered_mbps))
        .collect();
    chart
        .draw_series(LineSeries::new(delivered.clone(), BLUE.stroke_width(2)))
        .map_err(&err)?
        .label("delivered")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(delivered.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))
        .map_err(&err)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(&err)?;

    let loss_max = steps
        .iter()
        .map(|s| s.undelivered_ratio * 100.0)
        .fold(1.0, f64::max)
        .min(100.0);
    let mut below = ChartBuilder::on(&lower)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..loss_max * 1.05)
        .map_err(&err)?;
    below
        .configure_mesh()
        .x_desc("offered load, Mbit/s")
        .y_desc("undelivered, %")
        .draw()
        .map_err(&err)?;
    let undelivered: Vec<(f64, f64)> = steps
        .iter()
        .map(|s| (s.offered_mbps, s.undelivered_ratio * 100.0))
        .collect();
    below
        .draw_series(LineSeries::new(undelivered.clone(), RED.stroke_width(2)))
        .map_err(&err)?;
    below
        .draw_series(undelivered.iter().map(|p| Circle::new(*p, 3, RED.filled())))
        .map_err(&err)?;
    root.present().map_err(&err)?;
    Ok(())
}

/// Round-trip time against percentile, on the usual "nines" axis.
pub(crate) fn latency_svg(path: &Path, hist: &RttHistogram, title: &str) -> anyhow::Result<()> {
    let err = plot_err(path);
    if hist.is_empty() {
        return Err(anyhow!("no round trips to plot"));
    }
    // Up to 99.99 %, or as far as the sample count supports.
    let max_nines = (hist.len() as f64).log10().floor().clamp(1.0, 4.0);
    let mut points: Vec<(f64, f64)> = (0..=(max_nines as u32 * 100))
        .map(|k| {
            let x = f64::from(k) / 100.0;
            let q = 1.0 - 10f64.powf(-x);
            (x, hist.value_at_quantile(q) as f64 / 1e3)
        })
        .collect();
    points.push((max_nines, hist.max() as f64 / 1e3));
    let y_max = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_nines, 0f64..y_max)
        .map_err(&err)?;
    let label = |x: &f64| {
        let pct = (1.0 - 10f64.powf(-x)) * 100.0;
        let text = format!("{pct:.4}");
        format!("{}%", text.trim_end_matches('0').trim_end_matches('.'))
    };
    chart
        .configure_mesh()
        .x_labels(max_nines as usize + 1)
        .x_label_formatter(&label)
        .x_desc("percentile")
        .y_desc("round trip, microseconds")
        .draw()
        .map_err(&err)?;
    chart
        .draw_series(LineSeries::new(points, BLUE.stroke_width(2)))
        .map_err(&err)?;
    root.present().map_err(&err)?;
    Ok(())
}
