//! Go's `flag` syntax over clap's definitions, so a derper command line runs as it is.
//!
//! derper parses its command line with Go's `flag` package: one or two dashes before any
//! name (`-hostname`, `--hostname`), the value after `=` or as the next argument, booleans
//! only as `-b` or `-b=value`, `--` ending the flags, and no short options at all (so no
//! clustering: `-acme-ip-certs` is one name). [`translate`] reads a command line that way,
//! with the names and aliases it finds in clap's [`Command`] and the [`GoKind`] each flag
//! declares beside its definition (a table per flag block, which a test holds to the
//! flags and their parsers), and rewrites every flag as `--long=value` for clap, which then
//! applies defaults, conflicts and requirements, and writes `--help`.
//!
//! Values are read as Go reads them before clap sees them: booleans by `strconv.ParseBool`,
//! integers by `strconv.ParseInt(s, 0, 64)` (base prefixes, `_` separators) and floats by
//! `strconv.ParseFloat`, whatever type the flag's parser produces; durations are the value
//! parsers' own business ([`crate::duration`]). Each value then goes through its flag's own
//! parser, and a refusal is told from clap's error kind and context, in Go's words.
//!
//! Two deliberate differences from Go, both where derper silently drops part of a command
//! line: a positional argument (which ends Go's flags and is then ignored by derper, along
//! with every flag after it) is an error naming it, and so is a value given to a boolean as
//! a separate argument (`-verify-clients false`), which is the usual way to meet the first.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, ArgAction, Command};

/// What a command line asks for, once read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Translated {
    /// The arguments for clap: the program name, then `--long=value` for each flag.
    Args(Vec<OsString>),
    /// `-h` (short help) or `-help`/`--help` (long help).
    Help { long: bool },
}

/// How Go's flag package would read a flag: the `flag.*` function derper declares it with,
/// or would for derpd's own flags. Declared per flag rather than guessed from the type its
/// parser produces, so that a parser returning a type of its own (a newtype, a checked
/// wrapper) keeps Go's syntax for its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GoKind {
    /// `flag.Bool`: `-b` or `-b=value` (`strconv.ParseBool`), never a separate value.
    Bool,
    /// `flag.Int` and its kin: `strconv.ParseInt(s, 0, 64)`, handed to the flag's parser in
    /// decimal.
    Int,
    /// `flag.Float64`: `strconv.ParseFloat`, handed to the flag's parser in Rust's form.
    Float,
    /// `flag.Duration`: the flag's parser reads Go's syntax ([`crate::duration`]); checked
    /// when met, as Go parses it then.
    Duration,
    /// `flag.String`: handed to the flag's parser as written, and checked once every flag is
    /// read (derper checks its strings after parsing, which `-h` never reaches).
    String,
}

/// Every flag's kind, by long name.
pub(crate) type GoKinds = [(&'static str, GoKind)];

/// The kind `kinds` declares for `arg`.
fn kind_of(kinds: &GoKinds, arg: &Arg) -> Option<GoKind> {
    let long = arg.get_long()?;
    kinds.iter().find(|(l, _)| *l == long).map(|(_, k)| *k)
}

/// Makes every boolean flag of `cmd` take Go's forms: `--b` sets it, `--b=false` clears it,
/// and no separate value is ever taken. A flag declared as a plain switch (clap's `SetTrue`)
/// becomes one that also takes `=true`/`=false`, keeping its default (false).
pub(crate) fn go_booleans(cmd: Command, kinds: &GoKinds) -> Command {
    cmd.mut_args(|arg| {
        if kind_of(kinds, &arg) != Some(GoKind::Bool) {
            return arg;
        }
        let defaults = arg.get_default_values();
        // As Go's usage text: a default is shown only when it is not the zero value.
        let off = defaults.is_empty() || defaults == ["false"];
        let arg = arg
            .action(ArgAction::Set)
            .value_parser(clap::value_parser!(bool))
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .value_name("BOOL")
            .hide_possible_values(true);
        if off {
            arg.default_value("false").hide_default_value(true)
        } else {
            arg
        }
    })
}

/// A path flag's value parser that, as Go's string flags, takes "" too: what "" means is
/// each flag's own (`Cli::unset_empty` in `cli.rs`).
pub(crate) fn go_path() -> impl clap::builder::TypedValueParser<Value = std::path::PathBuf> {
    clap::builder::TypedValueParser::map(
        clap::builder::OsStringValueParser::new(),
        std::path::PathBuf::from,
    )
}

/// A command line that cannot be read; the message is one line, in Go's words where Go has
/// them.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct FlagError(pub(crate) String);

impl std::fmt::Display for FlagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Every name a flag answers to in Go's syntax: its long name, its aliases and its short
/// letter (derper's `-a` and `-c` are names of one letter, not short options).
fn names(cmd: &Command) -> BTreeMap<String, &Arg> {
    let mut map = BTreeMap::new();
    for arg in cmd.get_arguments() {
        let longs = arg
            .get_long()
            .into_iter()
            .chain(arg.get_all_aliases().unwrap_or_default());
        for name in longs {
            map.insert(name.to_owned(), arg);
        }
        let shorts = arg
            .get_short()
            .into_iter()
            .chain(arg.get_all_short_aliases().unwrap_or_default());
        for c in shorts {
            map.insert(c.to_string(), arg);
        }
    }
    map
}

/// Reads `args` (the program name first) with Go's `flag` rules against `cmd`'s flags, each
/// read as `kinds` declares it.
pub(crate) fn translate(
    cmd: &Command,
    kinds: &GoKinds,
    args: impl IntoIterator<Item = OsString>,
) -> Result<Translated, FlagError> {
    let flags = names(cmd);
    let mut args = args.into_iter();
    let mut out = vec![args.next().unwrap_or_else(|| "derpd".into())];
    // Each boolean's last value, in order of first mention: given to clap only where it is
    // not the default, so that an explicit `-b=false` is, as in Go, the same as no `-b` (and
    // a `requires` on it does not fire).
    let mut bools: Vec<(&str, bool, bool)> = Vec::new();
    // The last flag, when it was a boolean without "=": the likely cause of a stray value.
    let mut bare_bool: Option<String> = None;
    // Values whose own parser runs once every flag is read: Go's flag package has read
    // strings and checked numbers' syntax by then, and derper checks the rest in its main,
    // which -h never reaches.
    let mut later: Vec<Pending> = Vec::new();
    while let Some(arg) = args.next() {
        let bytes = arg.as_bytes();
        if bytes.len() < 2 || bytes[0] != b'-' {
            return Err(positional(&arg, bare_bool.as_deref()));
        }
        if bytes == b"--" {
            if let Some(next) = args.next() {
                return Err(positional(&next, None));
            }
            break;
        }
        let body = &bytes[1..];
        let body = body.strip_prefix(b"-").unwrap_or(body);
        if body.is_empty() || body[0] == b'-' || body[0] == b'=' {
            return Err(FlagError(format!(
                "bad flag syntax: {}",
                arg.to_string_lossy()
            )));
        }
        let (name, value) = match body.iter().position(|&b| b == b'=') {
            Some(i) => (&body[..i], Some(OsStr::from_bytes(&body[i + 1..]))),
            None => (body, None),
        };
        let name = String::from_utf8_lossy(name).into_owned();
        let Some(def) = flags.get(&name) else {
            if name == "h" || name == "help" {
                return Ok(Translated::Help {
                    long: name == "help",
                });
            }
            return Err(unknown(&name, flags.keys()));
        };
        let Some(long) = def.get_long() else {
            return Err(FlagError(format!("-{name}: flag has no long name")));
        };
        let Some(kind) = kind_of(kinds, def) else {
            return Err(FlagError(format!(
                "-{name}: derpd declares no Go kind for this flag"
            )));
        };
        bare_bool = None;
        if kind == GoKind::Bool {
            let default_on = def.get_default_values() == ["true"];
            let on = match value {
                None => {
                    bare_bool = Some(name.clone());
                    true
                }
                Some(v) => parse_bool(v).ok_or_else(|| {
                    FlagError(format!(
                        "invalid boolean value {:?} for -{name}: want true or false \
                         (Go's 1, t, T, TRUE, True, 0, f, F, FALSE and False also work)",
                        v.to_string_lossy()
                    ))
                })?,
            };
            match bools.iter_mut().find(|(l, ..)| *l == long) {
                Some(entry) => entry.1 = on,
                None => bools.push((long, on, default_on)),
            }
            continue;
        }
        let written = match value {
            Some(v) => v.to_owned(),
            // Go takes the next argument whatever it looks like (`-a -1`, `-home --`).
            None => args
                .next()
                .ok_or_else(|| FlagError(format!("flag needs an argument: -{name}")))?,
        };
        let value = match kind {
            GoKind::Int => number(&name, &written, parse_int)?,
            GoKind::Float => number(&name, &written, parse_float)?,
            GoKind::Duration => {
                check_value(&name, def, &written, &written)?;
                written.clone()
            }
            GoKind::String | GoKind::Bool => written.clone(),
        };
        if kind != GoKind::Duration {
            later.push(Pending {
                name,
                def,
                written,
                value: value.clone(),
            });
        }
        let mut flag = OsString::from(format!("--{long}="));
        flag.push(value);
        out.push(flag);
    }
    for p in &later {
        check_value(&p.name, p.def, &p.written, &p.value)?;
    }
    for (long, on, default_on) in bools {
        if on != default_on {
            out.push(format!("--{long}={on}").into());
        }
    }
    Ok(Translated::Args(out))
}

/// A value met on the command line whose flag's parser has yet to run.
struct Pending<'a> {
    /// The name it was given under.
    name: String,
    def: &'a Arg,
    /// As written, for the message.
    written: OsString,
    /// As the parser takes it (a number rewritten from Go's syntax).
    value: OsString,
}

/// Runs `def`'s own parser on `value` (in a command of its own: the full one would also
/// apply rules between flags, which Go's flag package has none of). A refusal names the
/// value as `written` and gives the parser's reason, in Go's form.
pub(crate) fn check_value(
    name: &str,
    def: &Arg,
    written: &OsStr,
    value: &OsStr,
) -> Result<(), FlagError> {
    let probe = Command::new("derpd").no_binary_name(true).arg(
        Arg::new("value")
            .long("value")
            .action(ArgAction::Set)
            .allow_hyphen_values(true)
            .value_delimiter(def.get_value_delimiter())
            .value_parser(def.get_value_parser().clone()),
    );
    let mut arg = OsString::from("--value=");
    arg.push(value);
    probe.try_get_matches_from([arg]).map(drop).map_err(|e| {
        FlagError(format!(
            "invalid value {:?} for flag -{name}: {}",
            written.to_string_lossy(),
            reason(&e)
        ))
    })
}

/// Why a value parser refused a value, from clap's error kind and context (not its rendered
/// text, whose wording and layout are clap's to change).
fn reason(e: &clap::Error) -> String {
    match e.kind() {
        ErrorKind::ValueValidation => match std::error::Error::source(e) {
            Some(why) => why.to_string(),
            None => "parse error".to_owned(),
        },
        ErrorKind::InvalidValue => {
            let mut text = match e.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(valid)) => format!("want {}", one_of(valid)),
                _ => "not a value this flag takes".to_owned(),
            };
            if let Some(ContextValue::String(near)) = e.get(ContextKind::SuggestedValue) {
                text.push_str(&format!(" (did you mean {near}?)"));
            }
            text
        }
        ErrorKind::InvalidUtf8 => "not valid UTF-8".to_owned(),
        _ => "parse error".to_owned(),
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(values: &[String]) -> String {
    match values {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// A value read by `parse` and written back in the form clap's parsers read.
fn number<T: ToString>(
    name: &str,
    value: &OsStr,
    parse: fn(&str) -> Result<T, NumError>,
) -> Result<OsString, FlagError> {
    let text = value.to_str().unwrap_or("\u{fffd}");
    parse(text).map(|n| n.to_string().into()).map_err(|e| {
        FlagError(format!(
            "invalid value {:?} for flag -{name}: {}",
            value.to_string_lossy(),
            match e {
                NumError::Syntax => "parse error",
                NumError::Range => "value out of range",
            }
        ))
    })
}

fn positional(arg: &OsStr, after_bool: Option<&str>) -> FlagError {
    let arg = arg.to_string_lossy();
    FlagError(match after_bool {
        Some(flag) => format!(
            "unexpected argument {arg:?} after -{flag}: a boolean flag takes its value after \
             \"=\" (-{flag}={arg}); derper would stop reading flags here and ignore the rest"
        ),
        None => format!(
            "unexpected argument {arg:?}: derpd takes no positional arguments (derper would \
             stop reading flags here and ignore the rest)"
        ),
    })
}

fn unknown<'a>(name: &str, known: impl Iterator<Item = &'a String>) -> FlagError {
    let mut msg = format!("flag provided but not defined: -{name}");
    if let Some(near) = nearest(name, known) {
        msg.push_str(&format!(" (did you mean -{near}?)"));
    }
    FlagError(msg)
}

/// The known name closest to `name`, if one is close enough to be a typo of it (ignoring
/// case and `_` for `-`).
fn nearest<'a>(name: &str, known: impl Iterator<Item = &'a String>) -> Option<&'a str> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    let target = norm(name);
    let max = (target.chars().count() / 4).clamp(1, 3);
    known
        .filter(|k| k.len() > 1)
        .map(|k| (edit_distance(&target, &norm(k)), k))
        .filter(|(d, _)| *d <= max)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance, over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = (diag + usize::from(ca != cb)).min(up + 1).min(row[j] + 1);
            diag = up;
        }
    }
    row[b.len()]
}

/// Go's `strconv.ParseBool`, as derper reads its flags and its environment knobs.
pub(crate) fn parse_bool(v: &OsStr) -> Option<bool> {
    match v.as_bytes() {
        b"1" | b"t" | b"T" | b"TRUE" | b"true" | b"True" => Some(true),
        b"0" | b"f" | b"F" | b"FALSE" | b"false" | b"False" => Some(false),
        _ => None,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum NumError {
    Syntax,
    Range,
}

/// Go's rule for `_` in a number read with its base from its prefix: only between digits, or
/// between the base prefix and a digit.
fn underscores_ok(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s).as_bytes();
    let lower = |c: u8| c.to_ascii_lowercase();
    // '^' start, '0' digit or prefix, '_' underscore, '!' anything else.
    let (mut saw, mut i, mut hex) = (b'^', 0, false);
    if s.len() >= 2 && s[0] == b'0' && matches!(lower(s[1]), b'b' | b'o' | b'x') {
        (saw, i, hex) = (b'0', 2, lower(s[1]) == b'x');
    }
    for &c in &s[i..] {
        if c.is_ascii_digit() || hex && (b'a'..=b'f').contains(&lower(c)) {
            saw = b'0';
        } else if c == b'_' {
            if saw != b'0' {
                return false;
            }
            saw = b'_';
        } else if saw == b'_' {
            return false;
        } else {
            saw = b'!';
        }
    }
    saw != b'_'
}

/// Go's `strconv.ParseInt(s, 0, 64)`, widened to the range of `u64` for derpd's own unsigned
/// flags (clap then checks each flag's range).
fn parse_int(s: &str) -> Result<i128, NumError> {
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'+') => (false, &s[1..]),
        Some(b'-') => (true, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() {
        return Err(NumError::Syntax);
    }
    let lower = digits.to_ascii_lowercase();
    let (base, body) = if lower.len() >= 3 && lower.starts_with("0x") {
        (16, &digits[2..])
    } else if lower.len() >= 3 && lower.starts_with("0b") {
        (2, &digits[2..])
    } else if lower.len() >= 3 && lower.starts_with("0o") {
        (8, &digits[2..])
    } else if let Some(octal) = digits.strip_prefix('0') {
        (8, octal)
    } else {
        (10, digits)
    };
    if digits.contains('_') && !underscores_ok(s) {
        return Err(NumError::Syntax);
    }
    let mut n: u128 = 0;
    let mut range = false;
    for c in body.chars().filter(|&c| c != '_') {
        let d = c.to_digit(base).ok_or(NumError::Syntax)?;
        n = n * u128::from(base) + u128::from(d);
        if n > u128::from(u64::MAX) {
            // Keep reading: a syntax error later in the string wins, as in Go.
            range = true;
            n = u128::from(u64::MAX);
        }
    }
    if range {
        return Err(NumError::Range);
    }
    let n = n as i128;
    Ok(if neg { -n } else { n })
}

/// Go's `strconv.ParseFloat(s, 64)`: decimal and hexadecimal (`0x1p-2`) forms, `_` between
/// digits, and `inf`, `infinity` and `nan` in any case.
fn parse_float(s: &str) -> Result<f64, NumError> {
    let (neg, rest) = match s.as_bytes().first() {
        Some(b'+') => (false, &s[1..]),
        Some(b'-') => (true, &s[1..]),
        _ => (false, s),
    };
    let signed = |v: f64| if neg { -v } else { v };
    let lower = rest.to_ascii_lowercase();
    if lower == "inf" || lower == "infinity" {
        return Ok(signed(f64::INFINITY));
    }
    if lower == "nan" && rest.len() == s.len() {
        return Ok(f64::NAN);
    }
    if rest.contains('_') && !underscores_ok(s) {
        return Err(NumError::Syntax);
    }
    let clean: String = rest.chars().filter(|&c| c != '_').collect();
    let value = if let Some(hex) = clean
        .strip_prefix("0x")
        .or_else(|| clean.strip_prefix("0X"))
    {
        parse_hex_float(hex)?
    } else {
        let b = clean.as_bytes();
        let mantissa_end = b
            .iter()
            .position(|c| !(c.is_ascii_digit() || *c == b'.'))
            .unwrap_or(b.len());
        let mantissa = &clean[..mantissa_end];
        let digits = mantissa.bytes().filter(u8::is_ascii_digit).count();
        if digits == 0 || mantissa.matches('.').count() > 1 {
            return Err(NumError::Syntax);
        }
        let exp = &clean[mantissa_end..];
        if !exp.is_empty() {
            let e = exp.strip_prefix(['e', 'E']).ok_or(NumError::Syntax)?;
            let e = e.strip_prefix(['+', '-']).unwrap_or(e);
            if e.is_empty() || !e.bytes().all(|c| c.is_ascii_digit()) {
                return Err(NumError::Syntax);
            }
        }
        clean.parse::<f64>().map_err(|_| NumError::Syntax)?
    };
    if value.is_infinite() {
        return Err(NumError::Range);
    }
    Ok(signed(value))
}

/// The part of a hexadecimal float after `0x`: hex digits with at most one point, then a
/// mandatory binary exponent `p±n`.
fn parse_hex_float(s: &str) -> Result<f64, NumError> {
    let (mantissa, exp) = s.split_once(['p', 'P']).ok_or(NumError::Syntax)?;
    let (exp_neg, exp_digits) = match exp.as_bytes().first() {
        Some(b'-') => (true, &exp[1..]),
        Some(b'+') => (false, &exp[1..]),
        _ => (false, exp),
    };
    if exp_digits.is_empty() || !exp_digits.bytes().all(|c| c.is_ascii_digit()) {
        return Err(NumError::Syntax);
    }
    // Any exponent this large is out of range (or zero) whatever the mantissa.
    let exp: i64 = exp_digits.parse().unwrap_or(100_000);
    let exp = if exp_neg { -exp } else { exp };
    let mut bits: u64 = 0;
    let mut shift: i64 = 0;
    let (mut seen_point, mut digits) = (false, 0);
    for c in mantissa.chars() {
        if c == '.' {
            if seen_point {
                return Err(NumError::Syntax);
            }
            seen_point = true;
            continue;
        }
        let d = c.to_digit(16).ok_or(NumError::Syntax)?;
        digits += 1;
        if bits >> 60 == 0 {
            bits = bits << 4 | u64::from(d);
            if seen_point {
                shift -= 4;
            }
        } else if !seen_point {
            // Digits past 64 bits of precision only scale the value.
            shift += 4;
        }
    }
    if digits == 0 {
        return Err(NumError::Syntax);
    }
    let total = exp.saturating_add(shift).clamp(-2000, 2000) as i32;
    Ok(bits as f64 * 2f64.powi(total))
}

/// The bytes of a command line, for tests and callers that build one.
#[cfg(test)]
fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A command with every kind of flag, as derive writes them.
    #[derive(Debug, Parser)]
    #[command(name = "t", args_override_self = true)]
    struct T {
        #[arg(short = 'a', long = "addr", default_value = ":443")]
        addr: String,
        #[arg(long)]
        dev: bool,
        #[arg(long, default_value_t = true, action = ArgAction::Set)]
        stun: bool,
        #[arg(long, default_value_t = 80, allow_negative_numbers = true)]
        http_port: i32,
        #[arg(long)]
        limit: Option<f64>,
        #[arg(long, alias = "old-name")]
        new_name: Option<String>,
        /// A switch that needs another flag, as clap writes it.
        #[arg(long, requires = "new_name")]
        proxy: bool,
        /// A number whose parser makes a type of its own.
        #[arg(long, value_parser = parse_port)]
        port: Option<Port>,
        /// A float likewise.
        #[arg(long, value_parser = parse_share)]
        share: Option<Share>,
        #[arg(long, value_parser = crate::duration::parse_duration)]
        wait: Option<std::time::Duration>,
        #[arg(long, value_enum)]
        mode: Option<Mode>,
    }

    const T_KINDS: &GoKinds = &[
        ("addr", GoKind::String),
        ("dev", GoKind::Bool),
        ("stun", GoKind::Bool),
        ("http-port", GoKind::Int),
        ("limit", GoKind::Float),
        ("new-name", GoKind::String),
        ("proxy", GoKind::Bool),
        ("port", GoKind::Int),
        ("share", GoKind::Float),
        ("wait", GoKind::Duration),
        ("mode", GoKind::String),
    ];

    #[derive(Clone, Debug, PartialEq)]
    struct Port(u16);

    fn parse_port(s: &str) -> Result<Port, String> {
        s.parse::<u16>()
            .map(Port)
            .map_err(|_| format!("{s} is not a port"))
    }

    #[derive(Clone, Debug, PartialEq)]
    struct Share(f64);

    fn parse_share(s: &str) -> Result<Share, String> {
        match s.parse::<f64>() {
            Ok(v) if (0.0..=1.0).contains(&v) => Ok(Share(v)),
            _ => Err(format!("{s} is not between 0 and 1")),
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
    enum Mode {
        Fast,
        Slow,
        Careful,
    }

    fn run(args: &[&str]) -> Result<T, String> {
        let cmd = go_booleans(<T as clap::CommandFactory>::command(), T_KINDS);
        let mut argv = vec!["t"];
        argv.extend_from_slice(args);
        match translate(&cmd, T_KINDS, os(&argv)).map_err(|e| e.0)? {
            Translated::Args(a) => {
                let m = cmd.try_get_matches_from(a).map_err(|e| e.to_string())?;
                <T as clap::FromArgMatches>::from_arg_matches(&m).map_err(|e| e.to_string())
            }
            Translated::Help { long } => Err(format!("help long={long}")),
        }
    }

    #[test]
    fn every_go_form_sets_a_value() {
        for form in [
            &["-a", ":1"][..],
            &["--a", ":1"],
            &["-a=:1"],
            &["--a=:1"],
            &["-addr", ":1"],
            &["--addr=:1"],
        ] {
            assert_eq!(run(form).expect("parses").addr, ":1", "{form:?}");
        }
        for form in [
            &["-dev"][..],
            &["--dev"],
            &["-dev=true"],
            &["--dev=1"],
            &["-dev=T"],
        ] {
            assert!(run(form).expect("parses").dev, "{form:?}");
        }
        for form in [
            &["-stun=false"][..],
            &["--stun=0"],
            &["-stun=F"],
            &["-stun=FALSE"],
        ] {
            assert!(!run(form).expect("parses").stun, "{form:?}");
        }
        assert!(run(&[]).expect("parses").stun);
        assert!(!run(&[]).expect("parses").dev);
        // The last occurrence wins.
        let t = run(&["-dev", "-dev=false", "-a", ":1", "--a=:2"]).expect("parses");
        assert!(!t.dev);
        assert_eq!(t.addr, ":2");
        assert_eq!(
            run(&["-old-name", "x"]).expect("alias").new_name.as_deref(),
            Some("x")
        );
        // An explicit false is no flag at all, as in Go: what it requires is not required.
        assert!(!run(&["-proxy=false"]).expect("false needs nothing").proxy);
        assert!(!run(&["-proxy", "-proxy=0"]).expect("last wins").proxy);
        assert!(run(&["-proxy"]).is_err(), "true still needs -new-name");
        assert!(run(&["-proxy", "-new-name=x"]).expect("parses").proxy);
        assert!(
            !run(&["-stun=false", "-dev", "-stun=0"])
                .expect("parses")
                .stun
        );
    }

    #[test]
    fn values_are_taken_as_go_takes_them() {
        // The next argument, whatever it looks like.
        assert_eq!(run(&["-a", "-dev"]).expect("parses").addr, "-dev");
        assert_eq!(run(&["-a", "--"]).expect("parses").addr, "--");
        assert_eq!(run(&["-http-port", "-1"]).expect("parses").http_port, -1);
        // Everything after the first "=".
        assert_eq!(run(&["-a=x=y"]).expect("parses").addr, "x=y");
        assert_eq!(run(&["-a="]).expect("parses").addr, "");
        for (text, want) in [
            ("0x50", 80),
            ("0o17", 15),
            ("017", 15),
            ("0b11", 3),
            ("+8_0", 80),
            ("-0", 0),
        ] {
            assert_eq!(
                run(&["-http-port", text]).expect(text).http_port,
                want,
                "{text}"
            );
        }
        for (text, want) in [
            ("1e3", 1000.0),
            (".5", 0.5),
            ("1_000", 1000.0),
            ("0x1p4", 16.0),
            ("+Inf", f64::INFINITY),
        ] {
            assert_eq!(
                run(&["-limit", text]).expect(text).limit,
                Some(want),
                "{text}"
            );
        }
    }

    #[test]
    fn a_number_parsed_into_a_type_of_its_own_takes_gos_syntax() {
        for (text, want) in [
            ("0x50", 80),
            ("0X50", 80),
            ("0o17", 15),
            ("017", 15),
            ("0b1010", 10),
            ("8_080", 8080),
            ("+443", 443),
            ("0xFF_FF", 65535),
        ] {
            assert_eq!(
                run(&["-port", text]).expect(text).port,
                Some(Port(want)),
                "{text}"
            );
            let eq = format!("--port={text}");
            assert_eq!(run(&[&eq]).expect(text).port, Some(Port(want)), "{eq}");
        }
        for (text, want) in [("0x1p-2", 0.25), ("5e-1", 0.5), ("0_0.5", 0.5)] {
            assert_eq!(
                run(&["-share", text]).expect(text).share,
                Some(Share(want)),
                "{text}"
            );
        }
        let err = |args: &[&str]| run(args).expect_err("should fail");
        assert_eq!(
            err(&["-port", "0x"]),
            "invalid value \"0x\" for flag -port: parse error"
        );
        assert_eq!(
            err(&["-port", "1__0"]),
            "invalid value \"1__0\" for flag -port: parse error"
        );
        // Go's syntax is read first, then the flag's own parser has its say, by the name and
        // value the command line used.
        assert_eq!(
            err(&["-port", "0x10000"]),
            "invalid value \"0x10000\" for flag -port: 65536 is not a port"
        );
        assert_eq!(
            err(&["-share=0x1p1"]),
            "invalid value \"0x1p1\" for flag -share: 2 is not between 0 and 1"
        );
    }

    #[test]
    fn parsers_refusals_are_told_in_gos_form() {
        let err = |args: &[&str]| run(args).expect_err("should fail");
        assert_eq!(
            err(&["-mode", "quick"]),
            "invalid value \"quick\" for flag -mode: want fast, slow or careful"
        );
        assert_eq!(
            err(&["-mode=carefull"]),
            "invalid value \"carefull\" for flag -mode: want fast, slow or careful \
             (did you mean careful?)"
        );
        assert_eq!(
            err(&["-wait", "5"]),
            "invalid value \"5\" for flag -wait: missing unit in duration \"5\""
        );
        assert_eq!(
            err(&["-http-port", "99999999999"]),
            "invalid value \"99999999999\" for flag -http-port: 99999999999 is not in \
             -2147483648..=2147483647"
        );
        // A duration is checked when met, as Go parses it then; a string only once every
        // flag is read, so the unknown flag after it is the error, as in Go.
        assert!(err(&["-wait=5", "-nosuch"]).contains("-wait"));
        assert!(err(&["-mode=quick", "-nosuch"]).contains("-nosuch"));
        assert_eq!(
            run(&["-wait", "1m30s"]).expect("parses").wait,
            Some(std::time::Duration::from_secs(90))
        );
        assert_eq!(run(&["-mode=slow"]).expect("parses").mode, Some(Mode::Slow));
    }

    #[test]
    fn a_flag_without_a_declared_kind_is_named() {
        let cmd = go_booleans(<T as clap::CommandFactory>::command(), T_KINDS);
        let partial: Vec<_> = T_KINDS
            .iter()
            .copied()
            .filter(|(l, _)| *l != "port")
            .collect();
        assert_eq!(
            translate(&cmd, &partial, os(&["t", "-port=1"])),
            Err(FlagError(
                "-port: derpd declares no Go kind for this flag".to_owned()
            ))
        );
    }

    #[test]
    fn mistakes_are_named() {
        let err = |args: &[&str]| run(args).expect_err("should fail");
        assert_eq!(err(&["-nosuch"]), "flag provided but not defined: -nosuch");
        assert_eq!(
            err(&["--nosuch=3"]),
            "flag provided but not defined: -nosuch"
        );
        assert_eq!(
            err(&["-http_port", "1"]),
            "flag provided but not defined: -http_port (did you mean -http-port?)"
        );
        // One name, never short options run together.
        assert_eq!(err(&["-acme"]), "flag provided but not defined: -acme");
        assert_eq!(err(&["-ad"]), "flag provided but not defined: -ad");
        assert_eq!(err(&["-a"]), "flag needs an argument: -a");
        assert_eq!(err(&["---dev"]), "bad flag syntax: ---dev");
        assert_eq!(err(&["-=x"]), "bad flag syntax: -=x");
        assert!(err(&["-dev=yes"]).starts_with("invalid boolean value \"yes\" for -dev"));
        assert!(err(&["-dev="]).starts_with("invalid boolean value \"\" for -dev"));
        assert_eq!(
            err(&["-http-port", "5.0"]),
            "invalid value \"5.0\" for flag -http-port: parse error"
        );
        assert_eq!(
            err(&["-http-port", "99999999999999999999"]),
            "invalid value \"99999999999999999999\" for flag -http-port: value out of range"
        );
        assert!(err(&["-limit", "1e400"]).ends_with("value out of range"));
        assert!(err(&["-stun", "false"]).starts_with(
            "unexpected argument \"false\" after -stun: a boolean flag takes its value after \"=\" (-stun=false)"
        ));
        assert!(err(&["x"]).starts_with("unexpected argument \"x\": derpd takes no positional"));
        assert!(err(&["-"]).starts_with("unexpected argument \"-\""));
        assert!(err(&["--", "x"]).starts_with("unexpected argument \"x\""));
        assert!(run(&["-dev", "--"]).expect("a lone -- ends the flags").dev);
    }

    #[test]
    fn help_in_every_form() {
        for (form, long) in [
            ("-h", false),
            ("--h", false),
            ("-help", true),
            ("--help", true),
            ("-h=1", false),
            ("-help=false", true),
        ] {
            assert_eq!(
                run(&[form]).unwrap_err(),
                format!("help long={long}"),
                "{form}"
            );
        }
        // Flags before it are read first, as Go does.
        assert!(
            run(&["-nosuch", "-h"])
                .expect_err("fails")
                .contains("nosuch")
        );
    }

    #[test]
    fn go_numbers() {
        for (s, want) in [
            ("0", 0),
            ("-0", 0),
            ("+7", 7),
            ("017", 15),
            ("0x1F", 31),
            ("0X1f", 31),
            ("0b101", 5),
            ("0B1", 1),
            ("0o17", 15),
            ("0O17", 15),
            ("1_000", 1000),
            ("0x_1f", 31),
            ("-9223372036854775808", i64::MIN.into()),
            ("18446744073709551615", u64::MAX.into()),
        ] {
            assert_eq!(parse_int(s), Ok(want), "{s}");
        }
        for s in [
            "", "+", "-", " 1", "1 ", "5.0", "0x", "08", "1__0", "_1", "1_", "0b2", "1e3",
        ] {
            assert_eq!(parse_int(s), Err(NumError::Syntax), "{s:?}");
        }
        assert_eq!(parse_int("18446744073709551616"), Err(NumError::Range));
        for (s, want) in [
            ("1", 1.0),
            ("-1.5", -1.5),
            (".5", 0.5),
            ("5.", 5.0),
            ("1e3", 1000.0),
            ("1E-3", 0.001),
            ("1_000.5", 1000.5),
            ("0x1p4", 16.0),
            ("0x1.8p1", 3.0),
            ("0X_1P-2", 0.25),
            ("inf", f64::INFINITY),
            ("-Infinity", f64::NEG_INFINITY),
            ("+INF", f64::INFINITY),
        ] {
            assert_eq!(parse_float(s), Ok(want), "{s}");
        }
        assert!(parse_float("NaN").expect("nan").is_nan());
        assert!(parse_float("nAn").expect("nan").is_nan());
        for s in [
            "", ".", "e3", "1e", "1e+", "1.2.3", "0x1", "0x1.8", "+nan", "infin", " 1", "1_",
            "1__0", "0xp1", "1f",
        ] {
            assert_eq!(parse_float(s), Err(NumError::Syntax), "{s:?}");
        }
        assert_eq!(parse_float("1e400"), Err(NumError::Range));
        assert_eq!(parse_float("0x1p2000"), Err(NumError::Range));
    }

    #[test]
    fn near_names() {
        let known: Vec<String> = ["hostname", "http-port", "a", "verify-clients"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(nearest("hostnme", known.iter()), Some("hostname"));
        assert_eq!(
            nearest("Verify_Clients", known.iter()),
            Some("verify-clients")
        );
        assert_eq!(nearest("nosuch", known.iter()), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
