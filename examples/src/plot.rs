//! Loss curves as PNG (plotters' bitmap backend). Text needs a TrueType font, which plotters
//! does not ship: the first of `BURN_ZERO_FONT` and a few usual system paths is used, and
//! without one the curve is drawn without labels rather than not at all.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

const FONT_PATHS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a sans-serif font once; false when none could be read.
fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let candidates = std::env::var_os("BURN_ZERO_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// Exponential moving average with weight `alpha` on the newest point.
fn smooth(points: &[(f64, f64)], alpha: f64) -> Vec<(f64, f64)> {
    let mut avg = None;
    points
        .iter()
        .map(|&(x, y)| {
            let a = avg.map_or(y, |a: f64| a + alpha * (y - a));
            avg = Some(a);
            (x, a)
        })
        .collect()
}

/// Draws `(step, loss)` points and their moving average to `png` (800×480).
pub fn loss_curve(points: &[(f64, f64)], png: &Path) -> Result<(), String> {
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if finite.is_empty() {
        return Err(format!("{}: no finite loss to plot", png.display()));
    }
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", png.display());
    let x_max = finite.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_max = finite.iter().map(|p| p.1).fold(f64::MIN, f64::max);
    let y_min = finite.iter().map(|p| p.1).fold(f64::MAX, f64::min);
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let labels = font_available();
    let root = BitMapBackend::new(png, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16);
    if labels {
        builder
            .caption("training loss", ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(56);
    }
    let mut chart = builder
        .build_cartesian_2d(0.0..x_max, (y_min - pad)..(y_max + pad))
        .map_err(|e| err(&e))?;
    if labels {
        chart
            .configure_mesh()
            .x_desc("optimizer step")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc("loss (nats/token)")
            .draw()
            .map_err(|e| err(&e))?;
    }
    let raw = RGBColor(160, 190, 230);
    chart
        .draw_series(LineSeries::new(finite.iter().copied(), &raw))
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(smooth(&finite, 0.2), BLUE.stroke_width(2)))
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smooth_starts_at_the_first_point_and_follows() {
        let s = smooth(&[(1.0, 4.0), (2.0, 2.0), (3.0, 2.0)], 0.5);
        assert_eq!(s, vec![(1.0, 4.0), (2.0, 3.0), (3.0, 2.5)]);
    }

    #[test]
    fn writes_a_png_and_rejects_no_data() {
        let dir = std::env::temp_dir().join(format!("bz-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("loss.png");
        let points: Vec<(f64, f64)> = (1..=40).map(|i| (i as f64, 5.0 / i as f64)).collect();
        loss_curve(&points, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(
            loss_curve(&[(1.0, f64::NAN)], &png)
                .unwrap_err()
                .contains("no finite")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
