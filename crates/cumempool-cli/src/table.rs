//! Aligned text tables for people.

/// Rows of cells printed with each column as wide as its widest cell.
#[derive(Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self { header: header.iter().map(|s| (*s).to_owned()).collect(), rows: Vec::new() }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        // A row may carry more cells than the header names (a refusal's note): its extra
        // columns get widths of their own rather than an index past the header's.
        let columns = self.rows.iter().map(Vec::len).chain([self.header.len()]).max().unwrap_or(0);
        let mut widths = vec![0; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let padded: Vec<String> =
                cells.iter().enumerate().map(|(i, c)| format!("{c:<width$}", width = widths[i])).collect();
            padded.join("  ").trim_end().to_owned()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str(&widths[..self.header.len()].iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
        out.push('\n');
        for row in &self.rows {
            out.push_str(&line(row));
            out.push('\n');
        }
        out
    }
}

/// `1048576` -> `1 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if n == u64::MAX {
        return "max".into();
    }
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 && (value / 1024.0).fract() == 0.0 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 && n >= 1024 {
        return format!("{n} B");
    }
    format!("{value} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_to_the_widest_cell() {
        let mut table = Table::new(&["a", "bb"]);
        table.row(vec!["long cell".into(), "x".into()]);
        let text = table.render();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines[0], "a          bb");
        assert_eq!(lines[2], "long cell  x");
    }

    #[test]
    fn a_row_longer_than_the_header_keeps_its_extra_cells() {
        let mut table = Table::new(&["a"]);
        table.row(vec!["x".into(), "extra".into()]);
        table.row(vec!["longer".into()]);
        let text = table.render();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines[0], "a");
        assert_eq!(lines[1], "------");
        assert_eq!(lines[2], "x       extra");
        assert_eq!(lines[3], "longer");
    }

    #[test]
    fn byte_counts_read_naturally() {
        assert_eq!(bytes(256), "256 B");
        assert_eq!(bytes(1 << 20), "1 MiB");
        assert_eq!(bytes(64 << 20), "64 MiB");
        assert_eq!(bytes(u64::MAX), "max");
        assert_eq!(bytes(1000), "1000 B");
    }
}
