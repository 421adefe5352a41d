//! The sequential block allocator: hands out blocks in increasing order from a cursor, stepping over the
//! backup superblock + GDT ranges of sparse_super groups. No block is ever handed out twice.

/// A sequential allocator over `[cursor, ∞)` minus the reserved ranges.
#[derive(Debug, Clone)]
pub struct Allocator {
    cursor: u64,
    /// Sorted, disjoint `[start, end)` ranges that must never be allocated.
    reserved: Vec<(u64, u64)>,
    /// Index of the first reserved range that ends after the cursor.
    next_reserved: usize,
}

impl Allocator {
    pub fn new(start: u64, reserved: Vec<(u64, u64)>) -> Self {
        let mut a = Allocator { cursor: start, reserved, next_reserved: 0 };
        a.skip_reserved();
        a
    }

    /// The next block that would be handed out.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    fn skip_reserved(&mut self) {
        while let Some(&(s, e)) = self.reserved.get(self.next_reserved) {
            if e <= self.cursor {
                self.next_reserved += 1;
            } else if s <= self.cursor {
                self.cursor = e;
                self.next_reserved += 1;
            } else {
                break;
            }
        }
    }

    /// `n` contiguous blocks (inode tables, the journal): skips ahead past a reserved range rather than
    /// straddling it. The skipped gap stays free.
    pub fn alloc_contiguous(&mut self, n: u64) -> u64 {
        loop {
            self.skip_reserved();
            match self.reserved.get(self.next_reserved) {
                Some(&(s, e)) if self.cursor + n > s => {
                    self.cursor = e;
                    self.next_reserved += 1;
                }
                _ => break,
            }
        }
        let start = self.cursor;
        self.cursor += n;
        start
    }

    /// One block.
    pub fn alloc_one(&mut self) -> u64 {
        self.alloc_contiguous(1)
    }

    /// `n` blocks as few pieces as possible, split only where a reserved range interrupts them.
    pub fn alloc_run(&mut self, n: u64) -> Vec<(u64, u64)> {
        let mut pieces = Vec::new();
        let mut left = n;
        while left > 0 {
            self.skip_reserved();
            let room = match self.reserved.get(self.next_reserved) {
                Some(&(s, _)) => s - self.cursor,
                None => u64::MAX,
            };
            let take = left.min(room);
            pieces.push((self.cursor, take));
            self.cursor += take;
            left -= take;
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_reserved() {
        let mut a = Allocator::new(3, vec![(10, 12), (20, 22)]);
        assert_eq!(a.alloc_contiguous(5), 3);
        assert_eq!(a.alloc_contiguous(3), 12); // 8..11 would straddle 10..12
        assert_eq!(a.alloc_run(10), vec![(15, 5), (22, 5)]);
        assert_eq!(a.alloc_one(), 27);
        let mut b = Allocator::new(10, vec![(10, 12)]);
        assert_eq!(b.alloc_one(), 12);
    }
}
